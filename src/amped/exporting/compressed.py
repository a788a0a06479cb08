"""The compressed-tensors layout: a quantized layer's tensors and the model's
``quantization_config``.

compressed-tensors (the format vLLM and llm-compressor load) reads a quantized Linear
as ``weight_packed``/``weight`` and ``weight_scale`` (and NVFP4's
``weight_global_scale``) beside its ``bias``, and the ``quantization_config`` of the
model's config.json, whose config group names the quantized layers and their
``QuantizationArgs``. Its conventions, which differ from amped's:

- E2M1 elements are packed two per byte, the element at the even index in the low
  nibble (``compressed_tensors.compressors.nvfp4.helpers``);
- MX scales are E8M0 exponents stored as uint8 (``2 ** (e - 127)``);
- NVFP4's ``weight_global_scale`` is the *reciprocal* of amped's tensor scale
  (compressed-tensors dequantizes ``e * (scale / global_scale)``), stored in float32:
  ``1 / tensor_scale`` rounded once.
"""

from __future__ import annotations

import torch

from amped.exporting.formats import ExportFormat
from amped.exporting.grid import LayerGrid
from amped.lowp.mx.block_cast import BlockTensor
from amped.lowp.mx.e2m1 import to_e2m1_codes

__all__ = ["layer_tensors", "quantization_config"]


def _packed(elements: torch.Tensor) -> torch.Tensor:
    codes = to_e2m1_codes(elements)  # uint8: sign bit 8, magnitude index 0..7
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def layer_tensors(grid: LayerGrid, fmt: ExportFormat) -> dict[str, torch.Tensor]:
    """The tensors of one quantized layer, by their names under the layer."""
    cast, block = grid.weight, fmt.block_format()
    assert isinstance(cast, BlockTensor)  # a compressed-tensors layout's grid
    tensors: dict[str, torch.Tensor] = {}
    if block.is_fp4:
        tensors["weight_packed"] = _packed(cast.elements)
    else:
        tensors["weight"] = cast.elements.to(block.elem_dtype)
    if block.is_mx:
        tensors["weight_scale"] = cast.scale_bits.clone()
    else:
        assert cast.tensor_scale is not None  # NVFP4 casts have one
        tensors["weight_scale"] = cast.scale_bits.view(torch.float8_e4m3fn).clone()
        global_scale = 1.0 / cast.tensor_scale.to(torch.float64)  # rounded once below
        tensors["weight_global_scale"] = global_scale.to(torch.float32).reshape(1)
    if grid.bias is not None:
        tensors["bias"] = grid.bias
    return {name: t.contiguous() for name, t in tensors.items()}


def quantization_config(fmt: ExportFormat, layers: list[str]) -> dict[str, object]:
    """config.json's ``quantization_config``: one group, the quantized layers by name."""
    group = {
        "targets": list(layers),
        "weights": fmt.weight_args(),
        "input_activations": fmt.input_args(),
        "output_activations": None,
        "format": fmt.compression,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": fmt.compression,
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": [],
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }
