"""The blockwise FP8 GEMM and the layer's three GEMMs against float64 on the same operands.

amped.lowp.float8.blockwise_gemm emulates the blockwise kernel: exact FP8 products,
float32 sums per 128-block, each block's sums times its two scales, blocks added in
float32. Its error against the exact (float64) product of the dequantized operands is
bounded by float32 accumulation (derived in that module): with u = 2**-24 and KB blocks,
``(128 + KB + 1) * u * (|a| @ |b|)``, plus the final rounding to the output dtype (half
an ulp: at most 2**-8 relative for bfloat16, whose significand has 8 bits). A block
scaled with another block's scale, or a tile's scale applied to the wrong rows, breaks
that bound by orders of magnitude. The casts themselves are torchao's bit for bit
(test_fp8_blockwise.py).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from amped.lowp import CONFIGS, Float8Config, Float8Linear
from amped.lowp.float8.blockwise import (
    ACTIVATION_TILE,
    COLUMN_TILE,
    WEIGHT_TILE,
    BlockwiseTensor,
    quantize_blockwise,
)
from amped.lowp.float8.blockwise_gemm import blockwise_mm, has_blockwise_scaled_mm
from amped.lowp.float8.config import CastRule

U32 = 2.0**-24
HALF_ULP = {torch.float32: 0.0, torch.bfloat16: 2.0**-8}


def _exact(a: BlockwiseTensor, b: BlockwiseTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 product of the dequantized operands (exact) and ``|a| @ |b|``."""
    a64 = a.data.to(torch.float64) * a.scale_inv_per_element().to(torch.float64)
    b64 = b.data.to(torch.float64) * b.scale_inv_per_element().to(torch.float64)
    return a64 @ b64, a64.abs() @ b64.abs()


def assert_within_accumulation_bound(
    out: torch.Tensor, a: BlockwiseTensor, b: BlockwiseTensor
) -> None:
    exact, magnitude = _exact(a, b)
    blocks = math.ceil(a.shape[1] / 128)
    accumulated = (128 + blocks + 1) * U32 * magnitude
    bound = accumulated + HALF_ULP[out.dtype] * (exact.abs() + accumulated)
    error = (out.to(torch.float64) - exact).abs()
    assert bool((error <= bound).all()), float((error - bound).max())


def _tensor(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    return (x * torch.logspace(-2, 2, cols)[None, :]).to(torch.bfloat16)


_GEMMS = [  # (m, k, n, b's tile, power-of-two scales, out dtype)
    (64, 256, 136, WEIGHT_TILE, False, torch.bfloat16),
    (40, 200, 72, WEIGHT_TILE, False, torch.float32),
    (40, 200, 72, WEIGHT_TILE, True, torch.bfloat16),
    (48, 300, 64, COLUMN_TILE, False, torch.bfloat16),
    (48, 300, 64, COLUMN_TILE, True, torch.float32),
]


@pytest.mark.parametrize(
    ("m", "k", "n", "b_tile", "power_of_2", "out_dtype"),
    _GEMMS,
    ids=[
        f"{m}x{k}x{n}-b{t[0]}x{t[1]}-{'pow2' if p else 'fp32'}-{str(d)[6:]}"
        for m, k, n, t, p, d in _GEMMS
    ],
)
def test_emulated_gemm_is_within_float32_accumulation(m, k, n, b_tile, power_of_2, out_dtype):
    a = quantize_blockwise(_tensor(m, k, 0), ACTIVATION_TILE, power_of_2=power_of_2)
    b = quantize_blockwise(_tensor(k, n, 1), b_tile, power_of_2=power_of_2)
    out = blockwise_mm(a, b, out_dtype)
    assert out.dtype is out_dtype and out.shape == (m, n)
    assert_within_accumulation_bound(out, a, b)


def test_operands_not_tiled_along_the_inner_dim_are_refused():
    a = quantize_blockwise(_tensor(8, 128, 0), COLUMN_TILE)
    b = quantize_blockwise(_tensor(128, 8, 1), WEIGHT_TILE)
    with pytest.raises(ValueError, match="tiled 128 long along K"):
        blockwise_mm(a, b, torch.float32)


def test_the_kernel_path_refuses_a_cpu():
    a = quantize_blockwise(_tensor(128, 128, 0), ACTIVATION_TILE)
    b = quantize_blockwise(_tensor(128, 128, 1), WEIGHT_TILE)
    with pytest.raises(RuntimeError, match="emulate=True"):
        blockwise_mm(a, b, torch.bfloat16, emulate=False)


@pytest.mark.parametrize("power_of_2", [False, True], ids=["fp32-scales", "pow2-scales"])
def test_layer_output_and_gradients_are_its_three_blockwise_gemms(power_of_2):
    """Float8Linear with the blockwise config under bfloat16 autocast: the output and both
    gradients are the blockwise GEMMs of the operands cast by their roles' tiles (input and
    grad_output 1x128, weight 128x128; 128x1 along tokens for grad_weight), within the
    accumulation bound against float64."""
    config = dataclasses.replace(CONFIGS["blockwise"], power_of_2=power_of_2)
    torch.manual_seed(0)
    linear = torch.nn.Linear(200, 144, bias=False)
    layer = Float8Linear.convert_(linear, config)
    assert layer.fp8_emulate  # no blockwise kernel on a CPU
    x = _tensor(2 * 70, 200, 2).reshape(2, 70, 200).requires_grad_()
    with torch.autocast("cpu", torch.bfloat16):
        out = layer(x)
    grad = _tensor(140, 144, 3).reshape(2, 70, 144)
    out.backward(grad)
    assert out.dtype is torch.bfloat16 and x.grad.dtype is torch.bfloat16
    assert layer.weight.grad.dtype is torch.float32

    def cast(t: torch.Tensor, tile: tuple[int, int]) -> BlockwiseTensor:
        return quantize_blockwise(t, tile, power_of_2=power_of_2)

    x2, go = x.detach().reshape(140, 200), grad.reshape(140, 144)
    wq = cast(layer.weight.detach(), WEIGHT_TILE)
    assert_within_accumulation_bound(out.reshape(140, 144), cast(x2, ACTIVATION_TILE), wq.t())
    grad_x = x.grad.reshape(140, 200)
    assert_within_accumulation_bound(grad_x, cast(go, ACTIVATION_TILE), wq)
    # grad_weight is rounded to bfloat16 (the GEMM's dtype) before the float32 parameter
    go_columns, x_columns = cast(go, COLUMN_TILE).t(), cast(x2, COLUMN_TILE)
    assert_within_accumulation_bound(layer.weight.grad.to(torch.bfloat16), go_columns, x_columns)


def test_a_config_mixing_blockwise_with_other_rules_is_refused():
    tensorwise = CastRule(torch.float8_e4m3fn, "tensorwise")
    with pytest.raises(ValueError, match="blockwise config casts every operand"):
        dataclasses.replace(CONFIGS["blockwise"], weight_for_grad_input=tensorwise)
    assert isinstance(CONFIGS["blockwise"], Float8Config) and CONFIGS["blockwise"].blockwise


def test_the_kernel_is_opt_in_and_refused_without_the_gpu():
    layer = Float8Linear.convert_(torch.nn.Linear(128, 128), CONFIGS["blockwise"])
    assert layer.fp8_emulate  # the default everywhere: the kernel is asked for
    with pytest.raises(ValueError, match="emulate=False with a blockwise config"):
        Float8Linear.convert_(torch.nn.Linear(128, 128), CONFIGS["blockwise"], emulate=False)


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and has_blockwise_scaled_mm(torch.device("cuda"))),
    reason="needs a Hopper GPU with torch.nn.functional.scaled_mm",
)
@pytest.mark.parametrize("b_tile", [WEIGHT_TILE, COLUMN_TILE], ids=["weight", "columns"])
def test_the_kernel_is_within_the_emulations_bound_on_hopper(b_tile):
    """torch's blockwise kernel against float64 on the same operands: the emulation's
    bound (float32 sums per block, then scaled). Not yet run on hardware."""
    a = quantize_blockwise(_tensor(256, 384, 0).cuda(), ACTIVATION_TILE)
    b = quantize_blockwise(_tensor(384, 256, 1).cuda(), b_tile)
    out = blockwise_mm(a, b, torch.bfloat16, emulate=False)
    cpu = [BlockwiseTensor(t.data.cpu(), t.scale_inv.cpu(), t.tile) for t in (a, b)]
    assert_within_accumulation_bound(out.cpu(), *cpu)
