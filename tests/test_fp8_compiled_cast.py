"""The block casts' compiled kernels against the same function run eagerly, bitwise.

:func:`amped.fp8.block_operand.block_operand` runs :func:`amped.fp8.block_kernel.block_kernel`
compiled (amped.fp8.compiled_cast); the eager call of the same function is the
reference, and its elements and scales are in turn held to torchao by
tests/test_block_cast.py. Inputs span 40 binades and hold zeros, ties between
neighbouring elements, float32 subnormals, NaN and inf. Every compile takes seconds,
so those tests are slow; the rest of the suite runs the casts eagerly (conftest.py).
"""

from __future__ import annotations

import copy

import pytest
import torch

from amped.autocast_mode import current_path
from amped.fp8 import BLOCK_CONFIGS, FP8_CONFIGS, compiled_cast, convert_to_fp8
from amped.fp8.block_cast import quantize_block
from amped.fp8.block_format import BLOCK_FORMATS
from amped.fp8.block_operand import block_operand
from amped.fp8.e2m1 import E2M1_VALUES
from amped.fp8.hadamard import hadamard_rows, hadamard_signs

pytestmark = pytest.mark.compiled_casts

CASES = {  # name: (format, blocked dim, 16x16 tiles)
    "mxfp8": ("mxfp8", -1, False),
    "mxfp8-dim0": ("mxfp8", 0, False),
    "mxfp8-e5m2": ("mxfp8-e5m2", -1, False),
    "mxfp4-dim0": ("mxfp4", 0, False),
    "nvfp4": ("nvfp4", -1, False),
    "nvfp4-dim0": ("nvfp4", 0, False),
    "nvfp4-tiles": ("nvfp4", -1, True),
}


def _suite(shape, dtype, seed=0, special=True):
    """Gaussian blocks spanning 40 binades; a zero block, a subnormal one, ties, and
    (``special``) a NaN block and an inf block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    flat = x.view(-1, 16)
    flat *= torch.exp2(torch.randint(-20, 20, (flat.shape[0], 1), generator=g).float())
    flat[0] = 0.0
    flat[1] *= 1e-39  # float32 subnormals (bfloat16 ones too)
    flat[2] = torch.tensor(E2M1_VALUES * 2) + 0.25
    if special:
        flat[5, 3] = float("nan")
        flat[7, 0] = float("-inf")
    return x.to(dtype)


def _eager(monkeypatch, *args, **kwargs):
    with monkeypatch.context() as patch:
        patch.setattr(compiled_cast, "compiles", lambda x: False)
        return block_operand(*args, **kwargs)


def _same(a, b):
    """Bitwise, NaN included."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("special", [False, True], ids=["finite", "nan-inf"])
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_operand_is_the_eager_one_bitwise(case, special, dtype, monkeypatch):
    name, dim, tiles = CASES[case]
    fmt = BLOCK_FORMATS[name]
    x = _suite((64, 96), dtype, special=special)
    kwargs = dict(dim=dim, tile_2d=tiles, dtype=dtype, keep_cast=True)
    compiled = block_operand(x, fmt, **kwargs)
    eager = _eager(monkeypatch, x, fmt, **kwargs)
    assert _same(compiled.values, eager.values)
    assert _same(compiled.cast.elements, eager.cast.elements)
    assert _same(compiled.cast.scale_bits, eager.cast.scale_bits)
    if fmt.is_mx:
        assert compiled.tensor_scale is None
    else:
        assert _same(compiled.tensor_scale, eager.tensor_scale)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_operand_is_the_cast_torchao_matches_read_back(case):
    """The values are ``quantize_block(x).block_values()`` (of ``x.t()`` for dim 0), and
    the cast kept is quantize_block's (of the transposed operand for dim 0)."""
    name, dim, tiles = CASES[case]
    fmt = BLOCK_FORMATS[name]
    x = _suite((64, 96), torch.bfloat16, seed=3, special=False)  # NaN bits: test above
    operand = block_operand(x, fmt, dim=dim, tile_2d=tiles, keep_cast=True)
    source = x.t() if dim == 0 else x
    reference = quantize_block(source.contiguous(), fmt, tile_2d=tiles)
    operand = operand.t() if dim == 0 else operand  # what the layers use
    assert _same(operand.values, reference.block_values(torch.bfloat16))
    assert torch.equal(operand.cast.elements, reference.elements)
    assert torch.equal(operand.cast.scale_bits, reference.scale_bits)


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape", [(3, 40, 64), (32, 32), (256, 512)], ids=["3d", "one-block", "wide"]
)
def test_other_shapes_compile_to_the_same_bits(shape, monkeypatch):
    fmt = BLOCK_FORMATS["mxfp4"]
    x = _suite(shape, torch.bfloat16, seed=4)
    assert _same(block_operand(x, fmt).values, _eager(monkeypatch, x, fmt).values)


@pytest.mark.slow
def test_stochastic_rounding_compiled_draws_what_eager_draws(monkeypatch):
    fmt = BLOCK_FORMATS["nvfp4"]
    x = _suite((64, 64), torch.float32, seed=5, special=False)
    compiled = block_operand(x, fmt, dim=0, generator=torch.Generator().manual_seed(7))
    eager = _eager(monkeypatch, x, fmt, dim=0, generator=torch.Generator().manual_seed(7))
    nearest = block_operand(x, fmt, dim=0)
    assert _same(compiled.values, eager.values)
    assert not torch.equal(compiled.values, nearest.values)


@pytest.mark.slow
@pytest.mark.parametrize("special", [False, True], ids=["finite", "nan-inf"])
def test_hadamard_rotated_cast_compiled_is_the_eager_one_and_the_rotated_cast(special, monkeypatch):
    """The rotation inside the kernel: compiled and eager give the same bits, and they are
    the cast of the rotated tensor (:func:`hadamard_rows`, then quantize_block)."""
    fmt = BLOCK_FORMATS["nvfp4"]
    x = _suite((64, 96), torch.bfloat16, seed=6, special=special)
    signs = hadamard_signs(3)
    kwargs = dict(dim=0, hadamard_signs=signs, keep_cast=True)
    compiled = block_operand(x, fmt, **kwargs)
    eager = _eager(monkeypatch, x, fmt, **kwargs)
    assert _same(compiled.values, eager.values)
    assert _same(compiled.cast.elements, eager.cast.elements)
    assert _same(compiled.cast.scale_bits, eager.cast.scale_bits)
    if not special:
        rotated = hadamard_rows(x.float(), signs)
        reference = quantize_block(rotated.t().contiguous(), fmt)
        assert _same(compiled.t().values, reference.block_values(torch.bfloat16))
        assert not torch.equal(compiled.values, block_operand(x, fmt, dim=0).values)


def _convert_every_layer(model: torch.nn.Module, recipe: str) -> None:
    if recipe in BLOCK_CONFIGS:
        convert_to_fp8(model, BLOCK_CONFIGS[recipe].replace(bf16_last=0.0))
    else:
        convert_to_fp8(model, FP8_CONFIGS[recipe], module_filter=lambda m, n: True)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4", "tensorwise", "rowwise", "delayed"])
def test_a_training_step_with_compiled_casts_is_bitwise_the_eager_step(recipe, monkeypatch):
    """Block recipes and FP8 recipes (whose casts and emulated GEMM pieces compile too)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    x = torch.randn(48, 64)  # 48 tokens: padded to the block in the grad-weight GEMM
    results = []
    for compiled in (True, False):
        ours = copy.deepcopy(model)
        _convert_every_layer(ours, recipe)
        with monkeypatch.context() as patch:
            if not compiled:
                patch.setattr(compiled_cast, "compiles", lambda x: False)
            with torch.autocast("cpu", torch.bfloat16):
                out = ours(x)
            out.float().pow(2).mean().backward()
        results.append([out, *(p.grad for p in ours.parameters())])
    for a, b in zip(*results, strict=True):
        assert _same(a, b)


@pytest.mark.slow
def test_a_compile_inside_an_autocast_region_leaves_its_path(monkeypatch):
    """The kernels compile on the worker thread: the caller's region keeps its path."""
    import amped

    x = _suite((32, 160), torch.bfloat16, seed=6)  # a shape no other test compiles
    with amped.autocast("cpu", torch.bfloat16):
        before = current_path("cpu")
        block_operand(x, BLOCK_FORMATS["mxfp8"])
        assert current_path("cpu") == before


def test_a_failed_compile_warns_once_and_casts_eagerly_with_the_same_bits(monkeypatch):
    """No C++ compiler (or an Inductor error): the eager function, the same values."""

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(compiled_cast, "_kernel", no_compiler)
    monkeypatch.setattr(compiled_cast, "_broken", {})  # this process's record, restored after
    fmt = BLOCK_FORMATS["mxfp8"]
    x = _suite((32, 64), torch.bfloat16, seed=8)
    with pytest.warns(RuntimeWarning, match="could not compile .* same values"):
        first = block_operand(x, fmt)
    assert not compiled_cast.compiles(x)
    assert _same(first.values, _eager(monkeypatch, x, fmt).values)
