"""The block casts' compiled kernels against the same function run eagerly, bitwise.

:func:`amped.lowp.mx.block_operand.block_operand` runs
:func:`amped.lowp.mx.block_kernel.block_kernel` compiled
(amped.lowp.float8.compiled_cast); the eager call of the same function is the reference,
and its elements and scales are in turn held to torchao by
tests/lowp/mx/test_block_cast.py. Inputs span 40 binades and hold zeros, ties between
neighbouring elements, float32 subnormals, NaN and inf. Every compile takes seconds,
so those tests are slow; the rest of the suite runs the casts eagerly (conftest.py).
"""

from __future__ import annotations

import pytest
import torch
from fp8_helpers import forced_emulated_gemm
from two_processes import run_in_two_processes

from amped._internal import testing
from amped.autocast_mode import current_path
from amped.lowp import convert_to_low_precision
from amped.lowp.float8 import compiled_cast
from amped.lowp.float8.config import FLOAT8_CONFIGS
from amped.lowp.float8.emulated_gemm import set_emulated_gemm
from amped.lowp.mx.block_cast import quantize_block
from amped.lowp.mx.block_config import BLOCK_CONFIGS
from amped.lowp.mx.block_format import BLOCK_FORMATS
from amped.lowp.mx.block_operand import block_operand
from amped.lowp.mx.e2m1 import E2M1_VALUES
from amped.lowp.mx.hadamard import hadamard_rows, hadamard_signs

pytestmark = [pytest.mark.compiled_casts, pytest.mark.xdist_group("compiled_casts_block")]

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
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
    with testing.casts("eager"):
        return block_operand(*args, **kwargs)


def _same(a, b):
    """Bitwise, NaN included."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _compile_case(case, dtype, threads):
    """In a worker process: ``case``'s operand of the finite and of the NaN/inf suite,
    compiled (one kernel serves both), and whether the kernel compiled (a failed
    compile warns and casts eagerly: then the comparison would prove nothing).

    MX cases also make the values-only operand (``("values", special)``), the kernel an
    emulated layer runs without the health monitor: a graph of its own, without the
    elements and scale bits."""
    torch.set_num_threads(threads)  # the kernel is compiled for the test's thread count
    testing.CASTS = "compiled"  # as the compiled_casts marker has it (conftest.py)
    name, dim, tiles = CASES[case]
    operands = {}
    for special in (False, True):
        x = _suite((64, 96), dtype, special=special)
        kwargs = dict(dim=dim, tile_2d=tiles, dtype=dtype, keep_cast=True)
        operands[special] = block_operand(x, BLOCK_FORMATS[name], **kwargs)
        if BLOCK_FORMATS[name].is_mx:
            kwargs["keep_cast"] = False
            operands["values", special] = block_operand(x, BLOCK_FORMATS[name], **kwargs)
    return operands, compiled_cast.compiles(x)


def _job(kind, *args):
    """In a worker process: one of the module's compiling jobs (see ``compiled_jobs``)."""
    jobs = {"case": _compile_case, "step": _compiled_step, "region": _cast_in_a_region}
    return jobs[kind](*args)


@pytest.fixture(scope="module")
def compiled_jobs():
    """The module's compiled results, {(kind, ...): result}: each case's operands, each
    recipe's step and the cast in a region, computed in one pair of worker processes
    (tests/helpers/two_processes.py; one pair, not one per fixture: each worker's start
    imports torch and amped), with the same functions, shapes, dtypes and thread count
    as here. Each kernel is a cold compile of seconds, one at a time in a process."""
    threads = torch.get_num_threads()
    jobs = {("case", c, d): ("case", c, d, threads) for c in CASES for d in DTYPES.values()}
    jobs |= {("step", *s): ("step", *s, threads) for s in STEP_RECIPES}
    jobs["region",] = ("region", threads)  # last: it counts the threads its worker starts
    return run_in_two_processes(_job, jobs)


@pytest.fixture(scope="module")
def compiled_operands(compiled_jobs):
    """Every case's compiled operands, {(case, dtype): ({special: operand}, compiled)}."""
    return {key[1:]: value for key, value in compiled_jobs.items() if key[0] == "case"}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("special", [False, True], ids=["finite", "nan-inf"])
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_operand_is_the_eager_one_bitwise(
    case, special, dtype, compiled_operands, monkeypatch
):
    name, dim, tiles = CASES[case]
    fmt = BLOCK_FORMATS[name]
    x = _suite((64, 96), dtype, special=special)
    kwargs = dict(dim=dim, tile_2d=tiles, dtype=dtype, keep_cast=True)
    operands, compiled_ok = compiled_operands[case, dtype]
    assert compiled_ok
    compiled = operands[special]
    eager = _eager(monkeypatch, x, fmt, **kwargs)
    assert _same(compiled.values, eager.values)
    assert _same(compiled.cast.elements, eager.cast.elements)
    assert _same(compiled.cast.scale_bits, eager.cast.scale_bits)
    if fmt.is_mx:
        assert compiled.tensor_scale is None
    else:
        assert _same(compiled.tensor_scale, eager.tensor_scale)


MX_CASES = [case for case, (name, _, _) in CASES.items() if BLOCK_FORMATS[name].is_mx]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("special", [False, True], ids=["finite", "nan-inf"])
@pytest.mark.parametrize("case", MX_CASES)
def test_compiled_values_only_operand_is_the_eager_one_bitwise(
    case, special, dtype, compiled_operands, monkeypatch
):
    """The values-only kernel (no elements, no scale bits) gives the values of the
    eager cast, NaN blocks included (bfloat16 values skip the NaN canonicalisation
    float32 values get: torch's conversion gives a NaN the same bits whatever its sign
    and payload)."""
    name, dim, tiles = CASES[case]
    x = _suite((64, 96), dtype, special=special)
    operands, compiled_ok = compiled_operands[case, dtype]
    assert compiled_ok
    compiled = operands["values", special]
    eager = _eager(monkeypatch, x, BLOCK_FORMATS[name], dim=dim, tile_2d=tiles, dtype=dtype)
    assert compiled.cast is None and eager.cast is None
    assert _same(compiled.values, eager.values)
    assert _same(compiled.values, operands[special].values)  # as with the cast kept


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_operand_is_the_cast_torchao_matches_read_back(case, compiled_operands):
    """The values are ``quantize_block(x).block_values()`` (of ``x.t()`` for dim 0), and
    the cast kept is quantize_block's (of the transposed operand for dim 0)."""
    name, dim, tiles = CASES[case]
    fmt = BLOCK_FORMATS[name]
    x = _suite((64, 96), torch.bfloat16, special=False)  # NaN bits: test above
    operands, compiled_ok = compiled_operands[case, torch.bfloat16]
    assert compiled_ok
    operand = operands[False]
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
        convert_to_low_precision(model, BLOCK_CONFIGS[recipe].replace(bf16_last=0.0))
    else:
        convert_to_low_precision(model, FLOAT8_CONFIGS[recipe], module_filter_fn=lambda m, n: True)


def _training_step(recipe: str) -> list[torch.Tensor]:
    """One step of a 2-layer MLP, every layer converted: the output and the gradients.

    Both layers are 64 wide, so that the second layer's casts reuse the first's kernels
    (each distinct shape is a cold compile of seconds): what the test proves, that the
    layers feed the kernels what the eager casts get, holds at any width; the kernels
    at other shapes (odd, 3-D, one block, wide) are held to eager above."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    x = torch.randn(48, 64)  # 48 tokens: padded to the block in the grad-weight GEMM
    _convert_every_layer(model, recipe)
    with torch.autocast("cpu", torch.bfloat16):
        out = model(x)
    out.float().pow(2).mean().backward()
    return [out.detach(), *(p.grad for p in model.parameters())]  # (detached: picklable)


def _compiled_step(recipe: str, gemm: str, threads: int) -> tuple[list[torch.Tensor], bool]:
    """In a worker process: the step with the casts compiled, its emulated GEMMs on the
    ``gemm`` path, and whether the casts compiled."""
    torch.set_num_threads(threads)  # the kernels are compiled for the test's thread count
    testing.CASTS = "compiled"  # as the compiled_casts marker has it (conftest.py)
    set_emulated_gemm(gemm)  # type: ignore[arg-type]
    return _training_step(recipe), compiled_cast.compiles(torch.zeros(()))


# (recipe, emulated GEMM path): every recipe on the bfloat16 path; on the float32 path
# (float32 operands: other kernels) one FP8 and one block recipe, each kernel being a
# cold compile of seconds
STEP_RECIPES = [(r, "bf16") for r in ("mxfp8", "nvfp4", "tensorwise", "rowwise", "delayed")]
STEP_RECIPES += [("mxfp8", "float32"), ("tensorwise", "float32")]


@pytest.fixture(scope="module")
def compiled_steps(compiled_jobs):
    """Each recipe's compiled step, {(recipe, gemm): (tensors, compiled)}: some ten
    kernels a recipe."""
    return {key[1:]: value for key, value in compiled_jobs.items() if key[0] == "step"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe,gemm", STEP_RECIPES, ids=[f"{r}-gemm-{g}" for r, g in STEP_RECIPES]
)
def test_a_training_step_with_compiled_casts_is_bitwise_the_eager_step(
    recipe, gemm, compiled_steps, monkeypatch
):
    """Block recipes and FP8 recipes (whose casts and emulated GEMM pieces compile too)."""
    compiled, compiled_ok = compiled_steps[recipe, gemm]
    assert compiled_ok
    monkeypatch.setattr(testing, "CASTS", "eager")
    with forced_emulated_gemm(gemm):
        eager = _training_step(recipe)
    for a, b in zip(compiled, eager, strict=True):
        assert _same(a, b)


def _cast_in_a_region(threads):
    """In a worker process: a block cast compiled inside a ``"strict"`` region (the
    ``KERNELS`` path), its bits and the eager ones, the paths around it, and the threads
    started meanwhile (Inductor's own helper threads are started first, by two unrelated
    compiles, should this worker not have compiled yet)."""
    import threading

    import amped

    torch.set_num_threads(threads)
    testing.CASTS = "compiled"
    for cols in (32, 64):
        torch.compile(lambda t: (t * 2).sum())(torch.randn(8, cols))
    started = []
    start = threading.Thread.start

    def counting(thread):
        started.append(thread.name)
        start(thread)

    threading.Thread.start = counting  # (this worker's own, until the job ends)
    try:
        x = _suite((32, 160), torch.bfloat16, seed=6)  # a shape no other test compiles
        policy = amped.Policy.preset("strict", "cpu")
        kernels = compiled_cast.compiled_kernels()
        with amped.autocast("cpu", policy=policy):
            paths = [current_path("cpu")]
            compiled = block_operand(x, BLOCK_FORMATS["mxfp8"]).values
            again = block_operand(x, BLOCK_FORMATS["mxfp8"]).values
            paths.append(current_path("cpu"))
        with amped.autocast("cpu", policy=policy):
            paths.append(current_path("cpu"))
    finally:
        threading.Thread.start = start
    # a kernel compiled in the region (not one this worker's earlier jobs left)
    ok = compiled_cast.compiles(x) and compiled_cast.compiled_kernels() == kernels + 1
    testing.CASTS = "eager"
    eager = block_operand(x, BLOCK_FORMATS["mxfp8"]).values
    bits = [t.reshape(-1).view(torch.uint8) for t in (compiled, again, eager)]
    return started, [p.name for p in paths], bits, ok


@pytest.mark.slow
def test_a_cast_compiled_inside_a_region_starts_no_thread_and_leaves_its_path(compiled_jobs):
    """The kernel compiles and runs on the calling thread, apart from its region."""
    started, paths, (compiled, again, eager), ok = compiled_jobs["region",]
    assert ok and started == []
    assert paths == ["KERNELS"] * 3
    assert torch.equal(compiled, eager) and torch.equal(again, eager)


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
