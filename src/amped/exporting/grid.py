"""The training grid of a model's low-precision layers: each weight cast as its forward
casts it.

A layer trained in the export's format is cast with its own config, through the same
function its forward calls (or one its forward's cast matches bit for bit): a
:class:`~amped.lowp.BlockLinear` by :func:`~amped.lowp.mx.block_cast.quantize_block`
(its scale rule, NVFP4's 16x16 weight tiles), a blockwise
:class:`~amped.lowp.Float8Linear` by
:func:`~amped.lowp.float8.blockwise.quantize_blockwise` in 128x128 tiles (its FP8
dtype, its power-of-two option). So the export stores exactly the elements and scales
the forward multiplied. A layer trained in another format is *re-quantized* with the
format's named recipe config: a new grid, not the trained one.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from amped._internal.errors import value_error
from amped.exporting.formats import ExportFormat
from amped.lowp import BlockLinear, Float8Linear
from amped.lowp.float8.blockwise import BLOCK, WEIGHT_TILE, BlockwiseTensor, quantize_blockwise
from amped.lowp.float8.config import FLOAT8_CONFIGS, Float8Config
from amped.lowp.mx.block_cast import BlockTensor, quantize_block
from amped.lowp.mx.block_config import BLOCK_CONFIGS

__all__ = ["LayerGrid", "gemm_weight", "layer_grid", "low_precision_layers", "trained_format"]


class LayerGrid(NamedTuple):
    """One layer's weight on the export's grid.

    Attributes:
        name: the layer's qualified name in the model.
        weight: the weight ``[out_features, in_features]`` cast, blocks along
            in_features (a BlockwiseTensor in 128x128 tiles for ``fp8-blockwise``).
        bias: the layer's bias (None without one), as the model holds it.
        trained: whether the forward trained on this grid (False: re-quantized).
        power_of_2: ``fp8-blockwise``: the recipe's power-of-two scales (the served
            forward casts its inputs so).
        transposed: the model keeps the weight as ``[in, out]`` (a transformers Conv1D).
    """

    name: str
    weight: BlockTensor | BlockwiseTensor
    bias: torch.Tensor | None
    trained: bool
    power_of_2: bool = False
    transposed: bool = False


def low_precision_layers(model: torch.nn.Module) -> dict[str, Float8Linear | BlockLinear]:
    """The layers a recipe converted to a low-precision format, by qualified name."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, (Float8Linear, BlockLinear))
    }


def trained_format(layer: Float8Linear | BlockLinear) -> str:
    """The name of the format ``layer`` trains in (``"nvfp4"``, ``"fp8-blockwise"`` ...)."""
    if isinstance(layer, BlockLinear):
        return layer.block_config.format.name
    if layer.float8_config.blockwise:
        return "fp8-blockwise"
    return f"fp8 ({layer.float8_config})"


def gemm_weight(layer: torch.nn.Module) -> torch.Tensor:
    """The weight as the forward GEMM takes it, ``[out_features, in_features]``
    (transformers' Conv1D keeps its transpose)."""
    weight = layer.weight
    assert isinstance(weight, torch.Tensor)
    return weight.t() if getattr(layer, "weight_transposed", False) else weight


def _refuse(name: str, fmt: ExportFormat, rule: str, shape: tuple[int, int]) -> ValueError:
    return value_error(
        f"{fmt.name} {rule}; layer {name!r} cannot be stored in it. Keep it in high "
        "precision (module_filter when preparing) or pad it",
        f"{name}.weight.shape (out_features, in_features)",
        shape,
    )


def _blockwise_grid(
    name: str, layer: Float8Linear | BlockLinear, weight: torch.Tensor, fmt: ExportFormat
) -> LayerGrid:
    own = layer.float8_config if isinstance(layer, Float8Linear) else None
    trained = own is not None and own.blockwise
    config: Float8Config = own if own is not None and trained else FLOAT8_CONFIGS["blockwise"]
    shape = (int(weight.shape[0]), int(weight.shape[1]))
    if any(dim > BLOCK and dim % BLOCK for dim in shape):
        # a last partial tile is what amped casts, but transformers' loader derives the
        # tile from the scale grid (dim / tiles) and vLLM's kernels take whole tiles
        rule = "stores 128x128 tiles: each dim a multiple of 128, or under 128 (one tile)"
        raise _refuse(name, fmt, rule, shape)
    cast = quantize_blockwise(
        weight, WEIGHT_TILE, dtype=config.weight.dtype, power_of_2=config.power_of_2
    )
    bias = layer.bias.detach() if layer.bias is not None else None
    transposed = bool(getattr(layer, "weight_transposed", False))
    return LayerGrid(name, cast, bias, trained, config.power_of_2, transposed)


@torch.no_grad()
def layer_grid(name: str, layer: Float8Linear | BlockLinear, fmt: ExportFormat) -> LayerGrid:
    """``layer``'s weight on ``fmt``'s grid: its own cast where it trained in ``fmt``,
    else the format's recipe config (a re-quantization).

    Raises:
        ValueError: a dim the format cannot hold, naming the layer.
    """
    weight = gemm_weight(layer).detach().contiguous()  # the same cast, any layout
    if fmt.is_deepseek:
        return _blockwise_grid(name, layer, weight, fmt)
    block = fmt.block_format()
    own = layer.block_config if isinstance(layer, BlockLinear) else None
    trained = own is not None and own.format == block
    config = own if own is not None and trained else BLOCK_CONFIGS[fmt.name]
    out_features, in_features = weight.shape
    size = block.block_size
    rows = 16 if config.weight_2d else 1  # NVFP4's 16x16 tiles span 16 rows
    if in_features % size or out_features % rows:
        tiles = " and 16x16 tiles (out_features a multiple of 16)" if rows > 1 else ""
        rule = f"stores a weight in blocks of {size} along in_features{tiles}"
        raise _refuse(name, fmt, rule, (out_features, in_features))
    cast = quantize_block(weight, block, config.scale_mode, tile_2d=config.weight_2d)
    bias = layer.bias.detach() if layer.bias is not None else None
    return LayerGrid(name, cast, bias, trained)
