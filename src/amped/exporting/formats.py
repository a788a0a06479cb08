"""The inference formats ``amped.export`` writes, as values.

==============  ===========================  ====================================
format          layout                       a quantized layer's tensors
==============  ===========================  ====================================
``nvfp4``       compressed-tensors           ``weight_packed`` (E2M1, two per byte),
                ``nvfp4-pack-quantized``     ``weight_scale`` (E4M3, 1x16 blocks),
                                             ``weight_global_scale`` (float32)
``mxfp8``       compressed-tensors           ``weight`` (E4M3), ``weight_scale``
                ``mxfp8-quantized``          (E8M0 exponents in uint8, 1x32 blocks)
``mxfp4``       compressed-tensors           ``weight_packed`` (E2M1), ``weight_scale``
                ``mxfp4-pack-quantized``     (E8M0 exponents in uint8, 1x32 blocks)
``fp8-block     DeepSeek-V3 / vLLM /         ``weight`` (E4M3), ``weight_scale_inv``
wise``          transformers fine-grained    (float32, one per 128x128 tile)
                FP8 (``quant_method: fp8``)
==============  ===========================  ====================================

Every format stores a weight as ``[out_features, in_features]`` with its blocks along
``in_features`` (the forward GEMM's inner dim), whatever layout the model keeps it in
(transformers' ``Conv1D`` stores it transposed). The weights of the layers that were
trained in high precision are written as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

from amped._internal.errors import value_error
from amped.lowp.mx.block_format import BLOCK_FORMATS, BlockFormat

__all__ = ["EXPORT_FORMATS", "ExportFormat", "export_format"]


@dataclass(frozen=True)
class ExportFormat:
    """One inference format.

    Attributes:
        name: the format's name (the recipe of the same name trains in it).
        block: the :class:`~amped.lowp.mx.block_format.BlockFormat` of its weights
            (None for ``fp8-blockwise``, which is not a block format of amped.lowp.mx).
        compression: compressed-tensors' name of the layout (``format`` in the
            config), or ``"fp8"`` (transformers' ``quant_method``) for DeepSeek's.
        strategy: compressed-tensors' quantization strategy of the weights ("" for
            DeepSeek's).
    """

    name: str
    block: BlockFormat | None
    compression: str
    strategy: str

    @property
    def is_deepseek(self) -> bool:
        """DeepSeek-V3's FP8 layout (``weight`` + ``weight_scale_inv``), not
        compressed-tensors'."""
        return self.block is None

    def block_format(self) -> BlockFormat:
        """The block format of a compressed-tensors layout."""
        assert self.block is not None, "fp8-blockwise is not a compressed-tensors layout"
        return self.block

    def weight_args(self) -> dict[str, object]:
        """compressed-tensors' ``QuantizationArgs`` of the weights, as JSON."""
        block = self.block_format()
        return {
            "num_bits": 4 if block.is_fp4 else 8,
            "type": "float",
            "symmetric": True,
            "group_size": block.block_size,
            "strategy": self.strategy,
            "dynamic": False,
            "scale_dtype": "torch.uint8" if block.is_mx else "torch.float8_e4m3fn",
        }

    def input_args(self) -> dict[str, object]:
        """The input activations' args: dynamic, every scale computed per batch, as the
        recipe trains (NVFP4's tensor scale too, where post-training tools calibrate
        a static one)."""
        return {**self.weight_args(), "dynamic": True}

    def __str__(self) -> str:
        return self.name


EXPORT_FORMATS: dict[str, ExportFormat] = {
    f.name: f
    for f in (
        ExportFormat("nvfp4", BLOCK_FORMATS["nvfp4"], "nvfp4-pack-quantized", "tensor_group"),
        ExportFormat("mxfp8", BLOCK_FORMATS["mxfp8"], "mxfp8-quantized", "group"),
        ExportFormat("mxfp4", BLOCK_FORMATS["mxfp4"], "mxfp4-pack-quantized", "group"),
        ExportFormat("fp8-blockwise", None, "fp8", ""),
    )
}
"""The export formats by name."""


def export_format(name: str) -> ExportFormat:
    """The format called ``name`` (ValueError naming the others)."""
    if name not in EXPORT_FORMATS:
        raise value_error(f"format is one of {sorted(EXPORT_FORMATS)}", "format", name)
    return EXPORT_FORMATS[name]
