"""The training grid of a model's low-precision layers: each weight cast as its forward
casts it.

A layer trained in the export's format (a :class:`~amped.lowp.BlockLinear` of that
format) is cast with its own config (scale rule, NVFP4's 16x16 weight tiles), through
the same :func:`~amped.lowp.mx.block_cast.quantize_block` its forward's cast matches bit
for bit: the export stores exactly the elements and scales the forward multiplied. A
layer trained in another format (a :class:`~amped.lowp.Float8Linear`, or another block
format) is *re-quantized* with the format's named recipe config
(:data:`~amped.lowp.mx.block_config.BLOCK_CONFIGS`): a new grid, not the trained one.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from amped._internal.errors import value_error
from amped.exporting.formats import ExportFormat
from amped.lowp import BlockLinear, Float8Linear
from amped.lowp.mx.block_cast import BlockTensor, quantize_block
from amped.lowp.mx.block_config import BLOCK_CONFIGS

__all__ = ["LayerGrid", "gemm_weight", "layer_grid", "low_precision_layers", "trained_format"]


class LayerGrid(NamedTuple):
    """One layer's weight on the export's grid.

    Attributes:
        name: the layer's qualified name in the model.
        weight: the weight ``[out_features, in_features]`` cast, blocks along in_features.
        bias: the layer's bias (None without one), as the model holds it.
        trained: whether the forward trained on this grid (False: re-quantized).
    """

    name: str
    weight: BlockTensor
    bias: torch.Tensor | None
    trained: bool


def low_precision_layers(model: torch.nn.Module) -> dict[str, Float8Linear | BlockLinear]:
    """The layers a recipe converted to a low-precision format, by qualified name."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, (Float8Linear, BlockLinear))
    }


def trained_format(layer: Float8Linear | BlockLinear) -> str:
    """The name of the format ``layer`` trains in (``"nvfp4"``, ``"fp8"`` ...)."""
    if isinstance(layer, BlockLinear):
        return layer.block_config.format.name
    return f"fp8 ({layer.fp8_config})"


def gemm_weight(layer: torch.nn.Module) -> torch.Tensor:
    """The weight as the forward GEMM takes it, ``[out_features, in_features]``
    (transformers' Conv1D keeps its transpose)."""
    weight = layer.weight
    assert isinstance(weight, torch.Tensor)
    return weight.t() if getattr(layer, "weight_transposed", False) else weight


@torch.no_grad()
def layer_grid(name: str, layer: Float8Linear | BlockLinear, fmt: ExportFormat) -> LayerGrid:
    """``layer``'s weight on ``fmt``'s grid: its own cast where it trained in ``fmt``,
    else the format's recipe config (a re-quantization).

    Raises:
        ValueError: a dim the format cannot block, naming the layer.
    """
    weight = gemm_weight(layer).detach().contiguous()  # the same cast, any layout
    own = layer.block_config if isinstance(layer, BlockLinear) else None
    trained = own is not None and own.format == fmt.block
    config = own if own is not None and trained else BLOCK_CONFIGS[fmt.name]
    out_features, in_features = weight.shape
    size = fmt.block.block_size
    rows = 16 if config.weight_2d else 1  # NVFP4's 16x16 tiles span 16 rows
    if in_features % size or out_features % rows:
        raise value_error(
            f"{fmt.name} stores a weight in blocks of {size} along in_features"
            + (" and 16x16 tiles (out_features a multiple of 16)" if rows > 1 else "")
            + f"; layer {name!r} cannot be stored in it. Keep it in high precision "
            "(module_filter when preparing) or pad it",
            f"{name}.weight.shape (out_features, in_features)",
            (out_features, in_features),
        )
    cast = quantize_block(weight, fmt.block, config.scale_mode, tile_2d=config.weight_2d)
    bias = layer.bias.detach() if layer.bias is not None else None
    return LayerGrid(name, cast, bias, trained)
