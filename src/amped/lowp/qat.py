"""Quantization-aware training: chosen layers' weights on a serving format's grid.

To serve a model in ``nvfp4``, ``mxfp8`` or ``fp8-blockwise`` while training it in
bfloat16, :func:`fake_quantize_weights` makes each chosen layer's forward use its weight
*as that format stores it* (cast and read back: the grid the format's own layers cast the
weight to, :func:`weight_grid`), while the gradient passes straight through to the
high-precision weight (the straight-through estimator)::

    forward:  w_used = grid(w)           (the served weight)
    backward: d loss / d w = d loss / d w_used

The optimizer keeps updating the high-precision weight, which the grid then follows;
the last steps of training learn to sit well on the grid, and post-training
quantization of the result (:func:`quantize_weights_`) loses less than quantizing a
model that never saw the grid. Activations are not fake-quantized here.

The grid is computed in float32 (``fp8-blockwise``: ``data * scale_inv`` of its 128x128
tiles; ``nvfp4``: E2M1 elements times their 16x16 tile's E4M3 scale times the float32
tensor scale; ``mxfp8``: E4M3 elements times their block's power of two), with the
format's named config (``amped.lowp.CONFIGS``); under bfloat16 autocast the linear
layer then rounds it to bfloat16, exactly for ``mxfp8`` and power-of-two blockwise
scales, to bfloat16's 8 bits otherwise.

Implemented as a ``torch.nn.utils.parametrize`` parametrization of ``weight``: the
optimizer's parameter is unchanged (``parametrizations.weight.original``);
:func:`remove_fake_quantization` removes it, keeping the high-precision weight.
"""

from __future__ import annotations

import torch
from torch.nn.utils import parametrize

from amped._internal.errors import value_error
from amped.lowp.convert import CONFIGS, plan_low_precision
from amped.lowp.float8.blockwise import quantize_weight_blockwise
from amped.lowp.mx.block_config import BlockConfig
from amped.lowp.mx.block_operand import block_operand

__all__ = [
    "QAT_FORMATS",
    "FakeQuantizedWeight",
    "fake_quantize_weights",
    "quantize_weights_",
    "remove_fake_quantization",
    "weight_grid",
]

QAT_FORMATS = ("fp8-blockwise", "mxfp8", "nvfp4")
"""The serving formats whose weight grid :func:`weight_grid` computes."""


def _check_format(fmt: str) -> None:
    if fmt not in QAT_FORMATS:
        raise value_error(
            f"Fake quantization targets one of {', '.join(QAT_FORMATS)} (the formats a "
            "model is exported and served in)",
            "format",
            fmt,
        )


@torch.no_grad()
def weight_grid(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """``weight`` (``[out, in]``) as ``fmt`` stores it, read back in float32.

    Raises:
        ValueError: ``fmt`` is not one of :data:`QAT_FORMATS`, or the weight's dims do
            not fit the format's blocks (MX: ``in`` a multiple of 32; NVFP4: both dims
            multiples of 16).
    """
    _check_format(fmt)
    if fmt == "fp8-blockwise":
        return quantize_weight_blockwise(weight).dequantize()
    config = CONFIGS[fmt]
    assert isinstance(config, BlockConfig)  # the block formats of QAT_FORMATS
    operand = block_operand(
        weight, config.format, config.scale_mode, tile_2d=config.weight_2d, dtype=torch.float32
    )
    assert operand.values is not None  # asked for in float32
    if operand.tensor_scale is None:
        return operand.values
    return operand.values * operand.tensor_scale


class FakeQuantizedWeight(torch.nn.Module):
    """The parametrization :func:`fake_quantize_weights` registers: the weight on
    ``format``'s grid forward, the gradient straight through backward."""

    def __init__(self, format: str) -> None:
        super().__init__()
        _check_format(format)
        self.format = format

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        grid = weight_grid(weight.detach(), self.format).to(weight.dtype)
        return weight + (grid - weight).detach()

    def extra_repr(self) -> str:
        return f"format={self.format!r}"


def _chosen(model: torch.nn.Module, fmt: str, layers: list[str] | None) -> list[str]:
    names = plan_low_precision(model, config=CONFIGS[fmt.removeprefix("fp8-")])
    chosen = names if layers is None else list(layers)
    if not chosen:
        raise value_error(
            f"Fake quantization to {fmt} found no layer: name them with layers=[...]",
            "layers",
            layers,
        )
    return chosen


def fake_quantize_weights(
    model: torch.nn.Module, format: str, layers: list[str] | None = None
) -> list[str]:
    """Put the weights of ``model``'s chosen layers on ``format``'s grid in every forward,
    gradients straight through (see the module); returns the layers' names.

    Args:
        model: the model (for ``amped.prepare``'s setups: ``setup.model``).
        format: one of :data:`QAT_FORMATS`.
        layers: qualified names of ``nn.Linear`` layers; default: those the format's
            recipe would convert (:func:`amped.lowp.convert.plan_low_precision`).

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
        >>> fake_quantize_weights(model, "mxfp8")
        ['0']
        >>> remove_fake_quantization(model)
    """
    _check_format(format)
    chosen = _chosen(model, format, layers)
    for name in chosen:
        module = model.get_submodule(name)
        parametrize.register_parametrization(module, "weight", FakeQuantizedWeight(format))
    return chosen


def remove_fake_quantization(model: torch.nn.Module) -> None:
    """Remove every :class:`FakeQuantizedWeight`, leaving the high-precision weights."""
    for module in model.modules():
        if parametrize.is_parametrized(module, "weight"):
            kinds = module.parametrizations["weight"]  # type: ignore[index]
            if any(isinstance(p, FakeQuantizedWeight) for p in kinds):
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)


@torch.no_grad()
def quantize_weights_(
    model: torch.nn.Module, format: str, layers: list[str] | None = None
) -> list[str]:
    """Post-training quantization: replace the chosen layers' weights, in place, by their
    ``format`` grid (:func:`weight_grid`); returns the layers' names."""
    _check_format(format)
    chosen = _chosen(model, format, layers)
    for name in chosen:
        weight = model.get_submodule(name).weight
        assert isinstance(weight, torch.Tensor)  # an nn.Linear's
        weight.copy_(weight_grid(weight, format).to(weight.dtype))
    return chosen
