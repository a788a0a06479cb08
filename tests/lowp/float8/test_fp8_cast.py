"""FP8 casts and the FP8 GEMM: scales against their closed form, saturation, the cast
round trip's SQNR, and the emulated GEMM against ``torch._scaled_mm``."""

from __future__ import annotations

import math

import pytest
import torch

from amped._internal.torch_compat import cpu_scaled_mm_takes_rowwise
from amped.lowp.float8.cast import (
    Float8Tensor,
    amax_of,
    amax_to_scale,
    cast_saturated,
    fp8_grid,
    quantize,
    quantize_rows_and_columns,
    sqnr,
)
from amped.lowp.float8.gemm import scaled_mm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

# Round trip of Gaussian data: e4m3 keeps 3 mantissa bits (measured 31.5 dB), e5m2 2
# (25.5 dB); the gate is 25 dB, below both, and torchao's own tests use the same order.
ROUND_TRIP_DB = 25.0

PAIRS = [(False, False), (True, True), (True, False), (False, True)]
PAIR_IDS = ["tensorwise", "rowwise", "rowwise-tensorwise", "tensorwise-rowwise"]


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_scale_is_fp8_max_over_amax_in_float64(dtype):
    amax = torch.tensor([3.0, 1e-3, 0.0, 7.123456789], dtype=torch.float32)
    fp8_max = torch.finfo(dtype).max
    expected = [fp8_max / max(float(a), 1e-12) for a in amax.double()]
    assert amax_to_scale(amax, dtype).tolist() == torch.tensor(expected).float().tolist()
    pow2 = amax_to_scale(amax, dtype, power_of_2=True).tolist()
    assert pow2 == [2.0 ** math.floor(math.log2(float(torch.tensor(e).float()))) for e in expected]


def test_cast_saturates_instead_of_overflowing():
    x = torch.tensor([1e6, -1e6, 1.0])
    for dtype in (E4M3, E5M2):
        data = cast_saturated(x, torch.tensor(1.0), dtype).float()
        fp8_max = torch.finfo(dtype).max
        assert data.tolist() == [fp8_max, -fp8_max, 1.0]


def test_rowwise_amax_and_scale_keep_the_reduced_dim():
    x = torch.tensor([[1.0, -4.0], [0.5, 2.0]])
    assert amax_of(x, "rowwise", -1).tolist() == [[4.0], [2.0]]
    q = quantize(x, E4M3, "rowwise", dim=0)
    assert q.scale.shape == (1, 2)
    assert q.dequantize().tolist() == x.tolist()  # small powers of two round-trip exactly
    with pytest.raises(ValueError, match="'tensorwise' or 'rowwise'"):
        amax_of(x, "blockwise")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        amax_to_scale(torch.tensor(1.0), torch.float16)


@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_round_trip_sqnr(dtype, granularity):
    torch.manual_seed(0)
    for x in (torch.randn(256, 688), torch.randn(688, 256, dtype=torch.bfloat16) * 1e-4):
        q = quantize(x, dtype, granularity, power_of_2=granularity == "rowwise")
        assert sqnr(x, q.dequantize()) >= ROUND_TRIP_DB


VALUES_DTYPES = [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("values_dtype", VALUES_DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_cast_writes_the_gemm_operand_beside_the_same_fp8_bytes(dtype, granularity, values_dtype):
    """``values_dtype``: the cast's FP8 bytes and scale are unchanged, and its values are
    those bytes converted exactly (e4m3 and e5m2 values fit bfloat16 and float32)."""
    torch.manual_seed(0)
    x = torch.randn(96, 80, dtype=torch.bfloat16) * 30  # some of it saturates e4m3
    plain = quantize(x, dtype, granularity, dim=0)
    q = quantize(x, dtype, granularity, dim=0, values_dtype=values_dtype)
    assert plain.values is None
    assert torch.equal(q.data.view(torch.uint8), plain.data.view(torch.uint8))
    assert torch.equal(q.scale, plain.scale)
    assert q.values is not None and q.values.dtype is values_dtype
    assert torch.equal(q.values, plain.data.to(torch.float64).to(values_dtype))
    assert torch.equal(q.t().values, q.values.t())
    with pytest.raises(ValueError, match="values_dtype"):
        quantize(x, dtype, values_dtype=torch.float16)
    pow2 = quantize(x, dtype, granularity, dim=0, power_of_2=True, values_dtype=values_dtype)
    assert pow2.dequantized and pow2.values is not None
    assert torch.equal(pow2.values, pow2.dequantize(torch.float64).to(values_dtype))


def _every_rounding_case(dtype):
    """float32 values covering each rounding case of ``dtype``: every mantissa whose low 12
    bits are zero (every tie and its neighbours, for 2 or 3 kept mantissa bits) and 2048
    random ones, in every binade from float32's subnormals to past ``dtype``'s largest
    value (clamped to it, as the casts clamp), both signs, signed zeros and NaN."""
    g = torch.Generator().manual_seed(0)
    ties = torch.arange(0, 1 << 23, 1 << 12, dtype=torch.int32)
    others = torch.randint(0, 1 << 23, (2048,), generator=g, dtype=torch.int32)
    ones = ((torch.cat([ties, others]) | (127 << 23)).view(torch.float32)).to(torch.float64)
    top = int(math.log2(torch.finfo(dtype).max)) + 2
    binades = torch.exp2(torch.arange(-149, top, dtype=torch.float64))
    v = (ones[None, :] * binades[:, None]).reshape(-1)
    v = torch.cat([v, -v, torch.tensor([0.0, -0.0, math.nan], dtype=torch.float64)])
    fp8_max = torch.finfo(dtype).max
    return v.to(torch.float32).clamp(-fp8_max, fp8_max)


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_fp8_grid_is_the_fp8_conversion_bitwise(dtype):
    """The float32 rounding the casts' GEMM operands are written with gives the values of
    torch's conversion to ``dtype`` and back, bit for bit (ties to even, subnormals,
    signed zeros; NaN stays NaN)."""
    v = _every_rounding_case(dtype)
    expected = v.to(dtype).to(torch.float32)
    got = fp8_grid(v, dtype)
    nan = torch.isnan(expected)
    assert torch.equal(nan, torch.isnan(got))
    assert torch.equal(got[~nan].view(torch.int32), expected[~nan].view(torch.int32))


@pytest.mark.parametrize("values_dtype", [None, *VALUES_DTYPES], ids=["bytes", "bf16", "fp32"])
@pytest.mark.parametrize("power_of_2", [True, False], ids=["pow2", "exact-scale"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_rows_and_columns_at_once_are_the_two_rowwise_casts(dtype, power_of_2, values_dtype):
    """Both orientations of a rowwise cast in one call: the bytes, scales and values of
    casting along each dim alone, bitwise, an inf and a NaN row included (whose scales
    are 0 and NaN, so the bytes come from the input, not the values)."""
    torch.manual_seed(0)
    x = torch.randn(40, 72, dtype=torch.bfloat16) * torch.exp2(torch.randint(-9, 9, (40, 1)))
    x[3, 5], x[7, 0], x[9, :4] = float("inf"), float("nan"), -0.0
    both = quantize_rows_and_columns(x, dtype, power_of_2, values_dtype)
    for q, dim in zip(both, (-1, 0), strict=True):
        alone = quantize(x, dtype, "rowwise", dim, power_of_2, None, values_dtype)
        assert _same_bits(q.data, alone.data) and _same_bits(q.scale, alone.scale)
        assert q.dequantized == alone.dequantized
        if values_dtype is not None:
            assert _same_bits(q.values, alone.values)


def _same_bits(a, b):
    """Bitwise, a NaN equal to any NaN."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
    nan = torch.isnan(a.to(torch.float32))
    bits_a, bits_b = a.view(ints[a.element_size()]), b.view(ints[b.element_size()])
    same_nans = torch.equal(nan, torch.isnan(b.to(torch.float32)))
    return same_nans and torch.equal(bits_a[~nan], bits_b[~nan])


def test_an_operand_cast_computes_its_bytes_when_read():
    """A cast that wrote the GEMM operand gives the bytes a plain cast writes, for the
    tensor and its transpose, and an Float8Tensor with neither bytes nor values is refused."""
    x = torch.randn(48, 32, dtype=torch.bfloat16) * 100
    for dtype in (E4M3, E5M2):
        plain = quantize(x, dtype, "rowwise", power_of_2=True)
        q = quantize(x, dtype, "rowwise", power_of_2=True, values_dtype=torch.bfloat16)
        assert q.dtype is dtype and q.shape == x.shape
        assert torch.equal(q.t().data.view(torch.uint8), plain.data.t().view(torch.uint8))
        assert torch.equal(q.data.view(torch.uint8), plain.data.view(torch.uint8))
    with pytest.raises(ValueError, match="values and FP8 dtype"):
        Float8Tensor(None, torch.tensor(1.0))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("a_rows,b_cols", PAIRS, ids=PAIR_IDS)
def test_dequantized_operands_give_the_scaled_results_bits(
    a_rows, b_cols, out_dtype, emulated_gemm
):
    """Power-of-two scales: the GEMM of the operands divided by their scales (what the
    cast writes, no scaling pass after) is the GEMM of the FP8 values scaled after,
    bit for bit (a power-of-two factor commutes with every rounding short of float32's
    subnormal range)."""
    torch.manual_seed(0)
    gran_a, gran_b = ("rowwise" if r else "tensorwise" for r in (a_rows, b_cols))
    dtype = torch.float32 if out_dtype is torch.float32 else emulated_gemm
    x, w = torch.randn(64, 512) * 3, torch.randn(48, 512) * 1e-2
    a = quantize(x, E4M3, gran_a, power_of_2=True, values_dtype=dtype)
    b = quantize(w, E5M2, gran_b, power_of_2=True, values_dtype=dtype).t()
    assert a.dequantized and b.dequantized
    folded = scaled_mm(a, b, out_dtype, emulate=True)
    unfolded = scaled_mm(
        Float8Tensor(a.data, a.scale), Float8Tensor(b.data, b.scale), out_dtype, emulate=True
    )
    assert torch.equal(folded, unfolded)
    half = scaled_mm(a, Float8Tensor(b.data, b.scale), out_dtype, emulate=True)  # one folded
    assert torch.equal(half, unfolded)


ROWWISE_CPU = "torch's CPU _scaled_mm takes row-wise scales from torch 2.12 on"


def test_rowwise_scaled_mm_on_old_cpu_torch_says_what_to_do():
    if cpu_scaled_mm_takes_rowwise():
        pytest.skip("this torch's CPU _scaled_mm takes row-wise scales")
    a, b = _operands(True, True)
    with pytest.raises(RuntimeError, match="emulate=True"):
        scaled_mm(a, b, torch.bfloat16)
    assert scaled_mm(a, b, torch.bfloat16, emulate=True).dtype == torch.bfloat16


def _operands(a_rows, b_cols, dtype_a=E4M3):
    torch.manual_seed(0)
    a = quantize(torch.randn(48, 64), dtype_a, "rowwise" if a_rows else "tensorwise")
    b = quantize(torch.randn(32, 64), E4M3, "rowwise" if b_cols else "tensorwise").t()
    return a, b


# The emulation against torch's CPU _scaled_mm: the same exact products, float32 sums in
# another order, the scales applied after the sums (the kernel: before, or on dequantized
# operands), and for a bfloat16 output the bfloat16 GEMM's own rounding of the sums
# before the scales (a second rounding). Measured (K = 64): 50-51 dB for a bfloat16
# output (that rounding dominates), 110-136 dB or bitwise for float32; 40 dB where the
# algorithm differs by design: far above the casts' own 25-31 dB, so a wrong cast fails.
SUMMATION_ORDER_DB = 40.0


@pytest.mark.parametrize("a_rows,b_cols", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_emulation_matches_scaled_mm_up_to_summation_order(
    a_rows, b_cols, out_dtype, emulated_gemm
):
    if (a_rows or b_cols) and not cpu_scaled_mm_takes_rowwise():
        pytest.skip(ROWWISE_CPU)
    a, b = _operands(a_rows, b_cols, E5M2 if not (a_rows or b_cols) else E4M3)
    real = scaled_mm(a, b, out_dtype)
    emulated = scaled_mm(a, b, out_dtype, emulate=True)
    assert real.dtype == emulated.dtype == out_dtype
    assert sqnr(real, emulated) >= SUMMATION_ORDER_DB
    exact = (a.dequantize().double() @ b.dequantize().double()).to(out_dtype)
    assert sqnr(exact, real) > 40  # one rounding of the output dominates


@pytest.mark.parametrize("a_rows,b_cols", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("k", [64, 2048], ids=["k64", "k2048"])
def test_emulation_is_the_exact_product_within_float32_accumulation(
    a_rows, b_cols, out_dtype, k, emulated_gemm
):
    """Every product of FP8 values is exact (in bfloat16 and float32 alike); only the
    float32 sums (at most K - 1 roundings of u = 2**-24 each, relative to the sum of
    magnitudes), the bfloat16 GEMM's rounding of its sum (h = 2**-8; on the bfloat16
    path and a bfloat16 output only: float32 GEMMs keep their sums), the two scale
    products (u each) and the output's rounding (h for bfloat16, u for float32; rowwise
    rounds to bfloat16 as torch's kernels do) may move the result off the float64
    product of the FP8 values:
    ``out = (exact + sums_error) * (1 + d1)(1 + d2)(1 + d3)(1 + d4)``."""
    torch.manual_seed(0)
    dtype = torch.float32 if out_dtype is torch.float32 else emulated_gemm
    gran_a, gran_b = ("rowwise" if r else "tensorwise" for r in (a_rows, b_cols))
    # rowwise as the recipes cast it: power-of-two scales, operands written dequantized
    a = quantize(torch.randn(48, k) * 3, E4M3, gran_a, power_of_2=a_rows, values_dtype=dtype)
    b = quantize(torch.randn(32, k), E5M2, gran_b, power_of_2=b_cols, values_dtype=dtype).t()
    out = scaled_mm(a, b, out_dtype, emulate=True).double()
    inv = a.scale.double().reciprocal() * b.scale.double().reciprocal()
    values_a, values_b = a.data.double(), b.data.double()
    exact = (values_a @ values_b) * inv
    magnitudes = (values_a.abs() @ values_b.abs()) * inv
    u, h = 2.0**-24, 2.0**-8
    rowwise = a_rows or b_cols
    gemm_rounding = h if dtype is torch.bfloat16 else 0.0
    output_rounding = h if out_dtype is torch.bfloat16 or rowwise else u
    growth = (1 + gemm_rounding) * (1 + u) ** 2 * (1 + output_rounding)
    bound = (k - 1) * u * magnitudes * growth + (growth - 1) * exact.abs()
    assert ((out - exact).abs() <= bound).all()
    assert (out != 0).any()


def test_operand_layouts_do_not_change_the_result():
    a, b = _operands(False, False)
    reference = scaled_mm(a, b, torch.bfloat16)
    a_colmajor = Float8Tensor(a.data.t().contiguous().t(), a.scale)
    b_rowmajor = Float8Tensor(b.data.contiguous(), b.scale)
    assert torch.equal(scaled_mm(a_colmajor, b_rowmajor, torch.bfloat16), reference)


@pytest.mark.parametrize(
    "module", ["amped.lowp.float8.cast", "amped.lowp.convert", "amped.doctor.lowp"], ids=lambda m: m
)
def test_docstring_examples_run(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_padding_the_inner_dim_leaves_the_product_unchanged():
    """CUDA's _scaled_mm needs the inner dim (the token count in the grad-weight GEMM)
    divisible by 16; padding with zeros must not change a bit."""
    from amped.lowp.float8.gemm import pad_inner

    if not cpu_scaled_mm_takes_rowwise():
        pytest.skip(ROWWISE_CPU)
    torch.manual_seed(0)
    a = quantize(torch.randn(32, 37), E5M2)
    b = quantize(torch.randn(37, 48), E4M3, "rowwise", dim=0)
    pa, pb = pad_inner(a, b)
    assert pa.data.shape == (32, 48) and pb.data.shape == (48, 48)
    assert torch.equal(scaled_mm(pa, pb, torch.bfloat16), scaled_mm(a, b, torch.bfloat16))
    assert pad_inner(pa, pb)[0] is pa  # already a multiple: untouched
