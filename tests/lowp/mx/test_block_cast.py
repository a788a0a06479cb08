"""Block casts against torchao 0.18's ``MXTensor.to_mx`` and ``NVFP4Tensor.to_nvfp4``:
scales, stored elements and the dequantized tensor, bitwise, on a suite of shapes and
values (blocks of zeros, ties, tiny and huge magnitudes, 3-D inputs)."""

from __future__ import annotations

import warnings

import pytest
import torch

from amped.lowp.mx.block_cast import nvfp4_tensor_scale, quantize_block
from amped.lowp.mx.block_format import BLOCK_FORMATS
from amped.lowp.mx.e2m1 import E2M1_VALUES, to_e2m1_codes, unpack_e2m1
from amped.lowp.mx.element_round import ELEMENTS, round_nearest_

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    nvfp4_tensor = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    ao_config = pytest.importorskip("torchao.prototype.mx_formats.config")

SHAPES = {"2d": (64, 128), "3d": (2, 48, 64), "row": (1, 32), "tall": (96, 32)}
MX_FORMATS = ["mxfp8", "mxfp8-e5m2", "mxfp4"]


def _suite(shape, dtype, seed=0):
    """Gaussian data with blocks spanning 40 binades, a zero block, a tiny block, ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    flat = x.view(-1, 16)
    binades = torch.randint(-20, 20, (flat.shape[0], 1), generator=g).float()
    flat *= torch.exp2(binades)
    flat[0] = 0.0
    if flat.shape[0] > 2:
        flat[1] *= 1e-38
        flat[2] = torch.tensor(E2M1_VALUES * 2) + 0.25  # ties between E2M1 neighbours
    return x.to(dtype)


def _ao_mx(x, fmt, mode):
    return mx_tensor.MXTensor.to_mx(
        x.contiguous(),
        fmt.elem_dtype,
        fmt.block_size,
        scaling_mode=ao_config.ScaleCalculationMode(mode),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("mode", ["floor", "ceil", "even", "rceil"])
@pytest.mark.parametrize("name", MX_FORMATS)
def test_mx_matches_torchao_bitwise(name, mode, shape, dtype):
    fmt = BLOCK_FORMATS[name]
    x = _suite(SHAPES[shape], dtype)
    ours = quantize_block(x, fmt, mode)
    theirs = _ao_mx(x, fmt, mode)
    assert torch.equal(ours.scale.view(torch.uint8), theirs.scale.view(torch.uint8))
    assert torch.equal(ours.data.view(torch.uint8), theirs.qdata.view(torch.uint8))
    for out in (torch.float32, torch.bfloat16):
        assert torch.equal(ours.dequantize(out), theirs.dequantize(out)), out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_nvfp4_matches_torchao_bitwise(shape, dtype):
    fmt = BLOCK_FORMATS["nvfp4"]
    x = _suite(SHAPES[shape], dtype, seed=1)
    ours = quantize_block(x, fmt)
    tensor_scale = nvfp4_tensor_scale(x)
    theirs = nvfp4_tensor.NVFP4Tensor.to_nvfp4(x.contiguous(), per_tensor_scale=tensor_scale)
    assert torch.equal(ours.tensor_scale, tensor_scale)
    assert torch.equal(ours.scale.view(torch.uint8), theirs.scale.view(torch.uint8))
    assert torch.equal(ours.data.view(torch.uint8), theirs.qdata.view(torch.uint8))
    for out in (torch.float32, torch.bfloat16):
        assert torch.equal(ours.dequantize(out), theirs.dequantize(out)), out


def test_e2m1_rounding_matches_torchao_on_every_boundary():
    kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")
    mid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 100.0])
    near = torch.cat([mid, torch.nextafter(mid, mid * 0), torch.nextafter(mid, mid * 2)])
    x = torch.cat([near, -near, torch.rand(10_000) * 14 - 7])
    codes = kernels.f32_to_f4_unpacked(x)
    theirs = kernels.f4_unpacked_to_f32(codes)
    assert torch.equal(round_nearest_(x.clone(), ELEMENTS[torch.float4_e2m1fn_x2]), theirs)
    assert torch.equal(to_e2m1_codes(x), codes)
    packed = quantize_block(x[:9984], BLOCK_FORMATS["mxfp4"]).data
    assert packed.dtype == torch.float4_e2m1fn_x2
    assert unpack_e2m1(packed).abs().max() <= 6


@pytest.mark.parametrize("name", ["mxfp8", "mxfp4", "nvfp4"])
def test_last_dim_off_the_block_is_a_clear_error_where_torchao_asserts(name):
    fmt = BLOCK_FORMATS[name]
    x = torch.randn(4, fmt.block_size + 8)
    with pytest.raises(ValueError, match=f"blocks of {fmt.block_size} elements"):
        quantize_block(x, fmt)
    with pytest.raises(AssertionError):
        if fmt.is_mx:
            _ao_mx(x, fmt, "floor")
        else:
            nvfp4_tensor.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=nvfp4_tensor_scale(x))


@pytest.mark.parametrize("name", ["mxfp8", "mxfp4", "nvfp4"])
def test_finite_inputs_never_give_inf_or_nan(name):
    fmt = BLOCK_FORMATS[name]
    x = torch.tensor([1.6e38, -1.6e38, 1e-45, 0.0] * 8)  # below 2**127: see block_cast
    x = torch.cat([x, torch.zeros(32)]).view(2, 32)
    back = quantize_block(x, fmt).dequantize()
    assert torch.isfinite(back).all()
    assert torch.equal(quantize_block(torch.zeros(2, 32), fmt).dequantize(), torch.zeros(2, 32))


def test_nan_marks_its_mx_block_and_inf_takes_the_largest_scale():
    x = torch.ones(2, 32)
    x[0, 3] = float("nan")
    x[1, 5] = float("inf")
    q = quantize_block(x, BLOCK_FORMATS["mxfp8"], "floor")
    assert q.scale.view(torch.uint8)[0].item() == 255
    assert torch.isnan(q.dequantize()[0]).all()
    assert q.scale.view(torch.uint8)[1].item() == 127 + 120  # 2**(128 - 8)
    assert q.dequantize()[1, 5].item() == float("inf")  # 448 * 2**120 is past float32
    assert (q.dequantize()[1, :5] == 0).all()


def test_bad_inputs_say_what_to_do():
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        quantize_block(torch.ones(32, dtype=torch.int32), BLOCK_FORMATS["mxfp8"])
    with pytest.raises(ValueError, match="scale_mode"):
        quantize_block(torch.ones(32), BLOCK_FORMATS["mxfp8"], "nearest")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="16x16 tiles"):
        quantize_block(torch.ones(8, 32), BLOCK_FORMATS["nvfp4"], tile_2d=True)
    with pytest.raises(ValueError, match="Stochastic rounding"):
        quantize_block(torch.ones(32), BLOCK_FORMATS["mxfp8"], generator=torch.Generator())


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_fp8_rounding_in_arithmetic_matches_torchs_cast(dtype, compute):
    """Every finite value of the format, the midpoints between neighbours (ties) and one
    compute-dtype ulp either side, subnormals included, past the maximum too."""
    values = torch.arange(256, dtype=torch.uint8).view(dtype).to(torch.float32)
    values = values[torch.isfinite(values) & (values >= 0)].sort().values
    mid = (values[:-1] + values[1:]) / 2
    x = torch.cat([values, mid, values * 1.5, torch.tensor([1e6, 1e-30, 0.0])]).to(compute)
    x = torch.cat([x, torch.nextafter(x, x * 2), torch.nextafter(x, x * 0)])
    x = torch.cat([x, -x])
    limit = torch.finfo(dtype).max
    expected = x.to(torch.float32).clamp(-limit, limit).to(dtype).to(compute)
    assert torch.equal(round_nearest_(x.clone(), ELEMENTS[dtype]), expected)


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_fp8_rounding_matches_torchs_cast_on_every_bfloat16_value(dtype, compute):
    """Every finite bfloat16 (all binades: the rounding finds each value's binade in
    arithmetic), and float32 values with random mantissas in binades -30..16."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = every[torch.isfinite(every)].to(compute)
    if compute is torch.float32:
        g = torch.Generator().manual_seed(0)
        mantissa = torch.randint(0, 1 << 23, (47, 4096), generator=g, dtype=torch.int32)
        exponent = torch.arange(-30, 17, dtype=torch.int32).unsqueeze(1) + 127
        x = torch.cat([x, ((exponent << 23) | mantissa).view(torch.float32).flatten()])
    limit = torch.finfo(dtype).max
    expected = x.to(torch.float32).clamp(-limit, limit).to(dtype).to(compute)
    assert torch.equal(round_nearest_(x.clone(), ELEMENTS[dtype]), expected)
