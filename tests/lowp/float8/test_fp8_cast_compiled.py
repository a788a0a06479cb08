"""The FP8 casts' compiled kernels against the same functions run eagerly, bitwise.

:func:`amped.lowp.float8.cast.amax_of` and :func:`amped.lowp.float8.cast.cast_saturated`
run compiled on a CPU (amped.lowp.float8.compiled_cast); their eager run is the
reference, held to torchao
in turn by tests/lowp/float8/test_fp8_torchao.py (a NaN's sign and payload excepted: see
``_same``). Inputs span 40 binades and hold zeros, float32
subnormals, values past the FP8 range after scaling, NaN and inf. Each compile takes
seconds, so these tests are slow; the rest of the suite casts eagerly (conftest.py).
A whole training step of each FP8 recipe, compiled against eager, is in
tests/lowp/mx/test_fp8_compiled_cast.py beside the block recipes' step.
"""

from __future__ import annotations

import pytest
import torch
from test_fp8_cast import _every_rounding_case
from two_processes import run_in_two_processes

from amped._internal import testing
from amped.lowp.float8 import compiled_cast
from amped.lowp.float8.cast import (
    Float8Tensor,
    cast_saturated,
    fp8_grid,
    quantize,
    quantize_rows_and_columns,
)
from amped.lowp.float8.gemm import scaled_mm

pytestmark = [pytest.mark.compiled_casts, pytest.mark.xdist_group("compiled_casts_float8")]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
VALUES_DTYPES = (torch.bfloat16, torch.float32)
SCALINGS = {  # name: (granularity, dim, power_of_2)
    "tensorwise": ("tensorwise", -1, False),
    "tensorwise-pow2": ("tensorwise", -1, True),
    "rowwise": ("rowwise", -1, True),
    "rowwise-dim0": ("rowwise", 0, True),
}


def _suite(shape, dtype, special, seed=0):
    """Gaussian rows spanning 40 binades; a zero row, a subnormal one, negative zeros, and
    (``special``) a NaN and an inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x *= torch.exp2(torch.randint(-20, 20, (shape[0], 1), generator=g).float())
    x[0] = 0.0
    x[1] *= 1e-39  # float32 subnormals (bfloat16 ones too)
    x[2, :3] = -0.0
    if special:
        x[5, 3] = float("nan")
        x[7, 0] = float("-inf")
    return x.to(dtype)


def _same(a, b):
    """Bitwise, except that a NaN equals any NaN: the sign and payload a NaN keeps through
    a product differ between eager x86 code and Inductor's (torch promises neither)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.reshape(-1), b.reshape(-1)
    nan_a, nan_b = torch.isnan(a.to(torch.float32)), torch.isnan(b.to(torch.float32))
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
    bits_a, bits_b = a.view(ints[a.element_size()]), b.view(ints[b.element_size()])
    return torch.equal(nan_a, nan_b) and torch.equal(bits_a[~nan_a], bits_b[~nan_b])


def _eager(monkeypatch, function, *args, **kwargs):
    with testing.casts("eager"):
        return function(*args, **kwargs)


def _compile_scaling(scaling, threads):
    """In a worker process: ``scaling``'s compiled casts, {(fp8, special): (bits, scale)}, and
    whether the kernels compiled (a failed compile warns and casts eagerly: then the
    comparison would prove nothing)."""
    torch.set_num_threads(threads)  # the kernels are compiled for the test's thread count
    testing.CASTS = "compiled"  # as the compiled_casts marker has it (conftest.py)
    granularity, dim, power_of_2 = SCALINGS[scaling]
    casts = {}
    for fp8 in (E4M3, E5M2):
        for special in (False, True):
            x = _suite((64, 96), torch.bfloat16, special)
            cast = quantize(x, fp8, granularity, dim, power_of_2)
            casts[fp8, special] = cast.data.view(torch.uint8), cast.scale  # FP8 bits pickle
            for values_dtype in VALUES_DTYPES:
                operand = quantize(x, fp8, granularity, dim, power_of_2, None, values_dtype)
                casts[fp8, special, values_dtype] = operand.values
    return casts, compiled_cast.compiles(x)


def _job(kind, *args):
    """In a worker process: one of the module's compiling jobs (see ``compiled_jobs``)."""
    jobs = {"scaling": _compile_scaling, "unsafe": _casts_under_unsafe_flags}
    return jobs[kind](*args)


@pytest.fixture(scope="module")
def compiled_jobs():
    """The module's worker results, {(kind, ...): result}, in one pair of worker processes
    (tests/helpers/two_processes.py; one pair for both kinds: each worker's start imports
    torch and amped): each kernel is a cold compile of seconds, one at a time in a
    process. The same functions, shapes, dtypes and thread count as here."""
    threads = torch.get_num_threads()
    jobs = {("scaling", s): ("scaling", s, threads) for s in SCALINGS}
    jobs["unsafe",] = ("unsafe",)
    return run_in_two_processes(_job, jobs)


@pytest.fixture(scope="module")
def compiled_casts(compiled_jobs):
    """Each scaling's compiled casts, {scaling: (casts, compiled)}."""
    return {key[1]: value for key, value in compiled_jobs.items() if key[0] == "scaling"}


@pytest.mark.slow
@pytest.mark.parametrize("special", [False, True], ids=["finite", "nan-inf"])
@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_compiled_quantize_is_the_eager_one_bitwise(
    fp8, scaling, special, compiled_casts, monkeypatch
):
    granularity, dim, power_of_2 = SCALINGS[scaling]
    x = _suite((64, 96), torch.bfloat16, special)
    casts, compiled_ok = compiled_casts[scaling]
    assert compiled_ok
    bits, scale = casts[fp8, special]
    compiled = Float8Tensor(bits.view(fp8), scale)
    eager = _eager(monkeypatch, quantize, x, fp8, granularity, dim, power_of_2)
    assert _same(compiled.data, eager.data)
    assert _same(compiled.scale, eager.scale)
    if not special:
        assert compiled.data.to(torch.float32).abs().max() > 0  # a real cast, not zeros
    for values_dtype in VALUES_DTYPES:  # the GEMM operand, written without the bytes
        values = casts[fp8, special, values_dtype]
        operand = _eager(
            monkeypatch, quantize, x, fp8, granularity, dim, power_of_2, None, values_dtype
        )
        assert _same(values, operand.values)
        assert _same(operand.data, eager.data)


@pytest.mark.slow
@pytest.mark.parametrize("special", [False, True], ids=["finite", "nan-inf"])
def test_compiled_float32_cast_with_a_given_scale_saturates_as_eager(special, monkeypatch):
    """The delayed-scaling path: a scale from history, so values past the range saturate."""
    # The GEMM test's operand shape: one e4m3 float32 cast kernel serves both.
    x = _suite((64, 96), torch.float32, special, seed=1)
    scale = torch.tensor(2.0**10)  # most of the suite lands past e4m3's 448
    compiled = cast_saturated(x, scale, E4M3)
    eager = _eager(monkeypatch, cast_saturated, x, scale, E4M3)
    assert _same(compiled, eager)
    assert (compiled.to(torch.float32).abs() == 448).any()  # saturated, not NaN


@pytest.mark.slow
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
def test_compiled_emulated_gemm_is_the_eager_one_bitwise(granularity, out_dtype, monkeypatch):
    """The emulated GEMM's compiled pieces (FP8 values to float32, the scaled result
    rounded to the output dtype) around the same matmul: the eager bits."""
    x = _suite((64, 96), torch.float32, special=False, seed=2)
    a = quantize(x, E4M3, granularity, power_of_2=granularity == "rowwise")
    b = quantize(x[:48], E5M2, granularity, power_of_2=granularity == "rowwise").t()
    compiled = scaled_mm(a, b, out_dtype, emulate=True)
    eager = _eager(monkeypatch, scaled_mm, a, b, out_dtype, emulate=True)
    assert compiled.dtype is out_dtype
    assert _same(compiled, eager)
    assert compiled.abs().max() > 0


def _casts_under_unsafe_flags():
    """In a worker process: e4m3 and e5m2 tensorwise GEMM operands, compiled (a shape no
    other job compiles) under Inductor's unsafe C++ flags, and eager."""
    from torch._inductor import config

    testing.CASTS = "compiled"
    x = _suite((40, 104), torch.float32, special=False, seed=3) * 100
    out = {}
    # What TORCHINDUCTOR_CPP_ENABLE_UNSAFE_MATH_OPT_FLAG=1 and
    # TORCHINDUCTOR_CPP_ENABLE_FLOATING_POINT_CONTRACT_FLAG=fast set: these defaults
    # (torch/_inductor/config.py reads the variables there, and nowhere else).
    unsafe = {"cpp.enable_unsafe_math_opt_flag": True}
    unsafe["cpp.enable_floating_point_contract_flag"] = "fast"
    with config.patch(unsafe):
        for fp8 in (E4M3, E5M2):
            compiled = quantize(x, fp8, "tensorwise", -1, False, None, torch.float32).values
            with testing.casts("eager"):
                eager = quantize(x, fp8, "tensorwise", -1, False, None, torch.float32).values
            out[fp8] = compiled, eager
    return out


@pytest.mark.slow
def test_unsafe_math_flags_of_the_environment_do_not_reach_the_cast_kernels(compiled_jobs):
    """``TORCHINDUCTOR_CPP_ENABLE_UNSAFE_MATH_OPT_FLAG`` (and the FMA contraction flag) set
    Inductor's C++ flags for a whole process; either lets the C++ compiler fold the casts'
    rounding arithmetic (amped.lowp.float8.cast.fp8_grid) into other bits, so the cast kernels are
    compiled with both off whatever the environment (Inductor's config defaults) says."""
    casts = compiled_jobs["unsafe",]
    for compiled, eager in casts.values():
        assert _same(compiled, eager)
        assert compiled.abs().max() > 0


def _amaxes(source, fp8_max):
    """Row amaxes: every positive finite bfloat16 value; or float32 values around
    ``fp8_max * 2**k`` for every k that keeps them normal, where ``fp8_max / amax`` is
    within a few ulps of a power of two (``log2`` rounds to an integer or just below)."""
    if source is torch.bfloat16:
        return torch.arange(1, 0x7F80, dtype=torch.int16).view(torch.bfloat16)
    steps = torch.arange(-16, 17, dtype=torch.float64) * 2.0**-23
    powers = torch.exp2(torch.arange(-120, 110, dtype=torch.float64))
    return (fp8_max * powers[:, None] * (1 + steps[None, :])).reshape(-1).to(torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("source", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_compiled_cast_computes_the_eager_scales(fp8, source, monkeypatch):
    """The cast kernel computes its own scales (amped.lowp.float8.fp8_kernel.scale_of: the float64
    quotient, log2, floor, exp2, compiled). Against the eager scales and values, bitwise,
    for every bfloat16 amax and for float32 amaxes whose scale lies next to a power of
    two; one scale per row, and (transposed) per column. The values (written without
    the saturating clamp: amped.lowp.float8.fp8_kernel.fp8_values) are also those of the
    clamped bytes, where ``log2`` rounded a scale up and ``amax * scale`` exceeds the
    FP8 maximum."""
    amax = _amaxes(source, torch.finfo(fp8).max)
    x = torch.stack([amax, -amax / 3], dim=1)  # each row's amax is its first entry
    for operand, dim in ((x, -1), (x.t().contiguous(), 0)):
        compiled = quantize(operand, fp8, "rowwise", dim, True, None, torch.bfloat16)
        eager = _eager(
            monkeypatch, quantize, operand, fp8, "rowwise", dim, True, None, torch.bfloat16
        )
        assert _same(compiled.scale, eager.scale)
        assert _same(compiled.values, eager.values)
        clamped = _eager(monkeypatch, quantize, operand, fp8, "rowwise", dim, True)
        assert _same(compiled.values, clamped.dequantize(torch.bfloat16))
    assert compiled_cast.compiles(x)
    if source is torch.float32:  # the clamp-free rounding met values past the maximum
        products = amax.double() * compiled.scale.reshape(-1).double()
        assert (products > torch.finfo(fp8).max).any()


@pytest.mark.slow
@pytest.mark.parametrize("rows", [5, 16, 70], ids=["5-rows", "16-rows", "70-rows"])
def test_compiled_column_casts_take_any_row_count(rows, monkeypatch):
    """Column amaxes run over blocks of 16 rows first (amped.lowp.float8.fp8_kernel.column_amax):
    fewer rows than a block, one block, and blocks with rows left over, alone and beside
    the row cast, give the eager bits."""
    x = _suite((rows, 96), torch.bfloat16, special=rows > 7)
    compiled = quantize(x, E5M2, "rowwise", 0, True, None, torch.bfloat16)
    eager = _eager(monkeypatch, quantize, x, E5M2, "rowwise", 0, True, None, torch.bfloat16)
    assert _same(compiled.scale, eager.scale) and _same(compiled.values, eager.values)
    both = quantize_rows_and_columns(x, E4M3, True, torch.float32)
    eager_both = _eager(monkeypatch, quantize_rows_and_columns, x, E4M3, True, torch.float32)
    for a, b in zip(both, eager_both, strict=True):
        assert _same(a.scale, b.scale) and _same(a.values, b.values)


def _grid_kernel(dtype, v):
    return fp8_grid(v, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_compiled_fp8_grid_is_the_fp8_conversion_bitwise(dtype):
    """The casts' rounding, compiled as the kernels compile it, on every rounding case of
    tests/lowp/float8/test_fp8_cast.py (ties, neighbours, subnormals, signed zeros, NaN):
    the bits of torch's conversion to ``dtype`` and back."""
    v = _every_rounding_case(dtype)
    assert compiled_cast.compiles(v)
    assert _same(compiled_cast.run(_grid_kernel, dtype, v), v.to(dtype).to(torch.float32))
