"""The three GEMMs of a :class:`~amped.lowp.Float8Linear` with a blockwise config.

Each operand is cast per tile (:mod:`amped.lowp.float8.blockwise`), tiled 128 long along
the GEMM's inner dim, as torchao's ``blockwise_fp8_training`` and DeepSeek-V3 do::

    output      = input [1x128]        @ weight.T [128x128]    (inner: in_features)
    grad_input  = grad_output [1x128]  @ weight   [128x128]    (inner: out_features)
    grad_weight = grad_output.T [1x128] @ input   [128x1]      (inner: tokens)

The weight's 128 x 128 tiles are the same in its two GEMMs, so its forward cast is
saved and reused by the backward; input and grad_output are cast again along tokens for
the grad-weight GEMM (the high-precision input is saved for that). ``grad_weight_hp``
runs the grad-weight GEMM in high precision instead. Each GEMM is
:func:`~amped.lowp.float8.blockwise_gemm.blockwise_mm`, emulated exactly unless the layer
was converted with ``emulate=False`` and the kernel takes its shapes, and reports to a
health observer as the other FP8 GEMMs do (:func:`amped.lowp.health.record_gemm`).
"""

from __future__ import annotations

from typing import Any

import torch

from amped.lowp.float8.blockwise import (
    ACTIVATION_TILE,
    COLUMN_TILE,
    WEIGHT_TILE,
    BlockwiseTensor,
    quantize_blockwise,
)
from amped.lowp.float8.blockwise_gemm import blockwise_mm, kernel_fits
from amped.lowp.float8.gemm import high_precision_mm
from amped.lowp.health import Operand, record_gemm

# The layer is a Float8Linear (amped.lowp.float8.linear, which imports this module): typed
# Any here to keep the import one way.
Float8Linear = Any

__all__ = ["BlockwiseLinearFunction"]


def _mm(
    layer: Float8Linear, a: BlockwiseTensor, b: BlockwiseTensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """The blockwise GEMM: the kernel where the layer may use it and it takes these
    shapes, else the emulation."""
    emulate = layer.fp8_emulate or not kernel_fits(a, b)
    return blockwise_mm(a, b, out_dtype, emulate=emulate)


def _cast(layer: Float8Linear, x: torch.Tensor, tile: tuple[int, int]) -> BlockwiseTensor:
    cfg = layer.float8_config
    rule = cfg.weight if tile == WEIGHT_TILE else cfg.input
    return quantize_blockwise(x, tile, dtype=rule.dtype, power_of_2=cfg.power_of_2)


def _cast_grad(layer: Float8Linear, go: torch.Tensor, tile: tuple[int, int]) -> BlockwiseTensor:
    cfg = layer.float8_config
    return quantize_blockwise(go, tile, dtype=cfg.grad_output.dtype, power_of_2=cfg.power_of_2)


class BlockwiseLinearFunction(torch.autograd.Function):
    """``x @ weight.T`` with the output, grad-input and grad-weight GEMMs in blockwise FP8."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, layer: Float8Linear) -> Any:
        x2 = x.reshape(-1, x.shape[-1])
        xq = _cast(layer, x2, ACTIVATION_TILE)
        wq = _cast(layer, weight, WEIGHT_TILE)
        out = _mm(layer, xq, wq.t(), x.dtype)
        operands: dict[str, Operand] = {"input": (x2, xq), "weight": (weight, wq)}
        record_gemm(layer, "forward", "output", out, operands)
        ctx.save_for_backward(x2, wq.data, wq.scale_inv)
        ctx.layer, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = layer, x.shape, x.dtype, weight.dtype
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        layer: Float8Linear = ctx.layer
        x2, w_data, w_scale_inv = ctx.saved_tensors
        go = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            goq = _cast_grad(layer, go, ACTIVATION_TILE)
            wq = BlockwiseTensor(w_data, w_scale_inv, WEIGHT_TILE)
            grad_x = _mm(layer, goq, wq, grad.dtype)
            operands: dict[str, Operand] = {"grad_output": (go, goq), "weight": (None, wq)}
            record_gemm(layer, "grad_input", "grad_input", grad_x, operands)
            grad_x = grad_x.reshape(ctx.x_shape).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            if layer.float8_config.grad_weight_hp:
                grad_w = high_precision_mm(go.t(), x2.to(go.dtype), layer.fp8_emulate)
                operands = {"grad_output": (go, None), "input": (x2, None)}
            else:
                go_columns = _cast_grad(layer, go, COLUMN_TILE)
                x_columns = _cast(layer, x2, COLUMN_TILE)
                grad_w = _mm(layer, go_columns.t(), x_columns, grad.dtype)
                operands = {"grad_output": (go, go_columns), "input": (x2, x_columns)}
            record_gemm(layer, "grad_weight", "grad_weight", grad_w, operands)
            grad_w = grad_w.to(ctx.w_dtype)
        return grad_x, grad_w, None
