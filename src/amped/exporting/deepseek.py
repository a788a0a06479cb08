"""DeepSeek-V3's FP8 layout (vLLM's and transformers' fine-grained FP8): write and read.

A quantized Linear is stored as ``weight`` (``float8_e4m3fn``, ``[out, in]``) and
``weight_scale_inv`` (float32, ``[ceil(out / 128), ceil(in / 128)]``, one per 128x128
tile) beside its ``bias``; config.json's ``quantization_config`` is
``{"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128,
128], "fmt": "e4m3", "modules_to_not_convert": [...]}``, the keys transformers'
``FineGrainedFP8Config`` reads (the Linear layers it must leave alone named, since it
converts every other ``nn.Linear``). A weight the model keeps transposed (transformers'
``Conv1D``, GPT-2's layers) is stored so, ``[in, out]``, with its tiles' scales
transposed alike, as its checkpoints store it (a 128x128 tile is one either way).

:func:`dequantize` is the format's public description written out, the independent
reader of ``check=True``: ``w[i, j] = weight[i, j] * weight_scale_inv[i // 128, j // 128]``
in float32. It calls nothing of amped's casts.
"""

from __future__ import annotations

import torch

from amped.exporting.grid import LayerGrid
from amped.lowp.float8.blockwise import BlockwiseTensor

__all__ = ["TILE", "dequantize", "layer_tensors", "quantization_config"]

TILE = 128


def layer_tensors(grid: LayerGrid) -> dict[str, torch.Tensor]:
    """The tensors of one quantized layer, by their names under the layer."""
    cast = grid.weight
    assert isinstance(cast, BlockwiseTensor)
    data, scale_inv = cast.data, cast.scale_inv.to(torch.float32)
    if grid.transposed:
        data, scale_inv = data.t(), scale_inv.t()
    tensors = {"weight": data, "weight_scale_inv": scale_inv}
    if grid.bias is not None:
        tensors["bias"] = grid.bias
    return {name: t.contiguous() for name, t in tensors.items()}


def quantization_config(high_precision_linears: list[str]) -> dict[str, object]:
    """config.json's ``quantization_config`` (see the module)."""
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [TILE, TILE],
        "fmt": "e4m3",
        "modules_to_not_convert": list(high_precision_linears),
    }


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """``weight * weight_scale_inv`` per 128x128 tile, in float32 (see the module)."""
    rows, cols = weight.shape
    per_element = scale_inv.repeat_interleave(TILE, dim=0).repeat_interleave(TILE, dim=1)
    return weight.to(torch.float32) * per_element[:rows, :cols]
