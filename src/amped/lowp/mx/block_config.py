"""How a block-scaled layer casts its GEMM operands: one immutable value per recipe.

Every operand of the three GEMMs (input, weight, grad_output; see
:mod:`amped.lowp.float8.config`) is cast to one
:class:`~amped.lowp.mx.block_format.BlockFormat`, blocks along each GEMM's inner dim.
The named configs (:data:`BLOCK_CONFIGS`):

- ``mxfp8``: torchao's MXFP8 training (e4m3 elements everywhere, ``rceil`` scales);
- ``mxfp4``: the same with E2M1 elements (no installed library trains in it);
- ``nvfp4``: NVIDIA's NVFP4 pretraining recipe ("Pretraining Large Language Models
  with NVFP4", 2025): 16x16 weight tiles, stochastic rounding of gradients, a random
  Hadamard transform on the weight-gradient GEMM's inputs, and the last 15% of the
  converted layers kept in bfloat16. Each part has a field that switches it off.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from amped._internal.errors import type_error, value_error
from amped.lowp.mx.block_format import BLOCK_FORMATS, SCALE_MODES, BlockFormat, ScaleMode

__all__ = ["BLOCK_CONFIGS", "BlockConfig"]


@dataclass(frozen=True)
class BlockConfig:
    """The block format of a layer's GEMMs and the NVFP4 recipe's parts.

    Attributes:
        format: the operands' :class:`~amped.lowp.mx.block_format.BlockFormat`.
        scale_mode: how MX block scales round (:mod:`amped.lowp.mx.block_format`).
        weight_2d: NVFP4: one scale per 16x16 weight tile, so the forward and the
            grad-input GEMM see the same quantized weight.
        stochastic_rounding: E2M1: round grad_output stochastically (both backward
            GEMMs), from a generator seeded per layer and saved in its state_dict.
        hadamard: rotate the weight-gradient GEMM's inputs by a 16x16 random Hadamard
            transform (:mod:`amped.lowp.mx.hadamard`) before the cast.
        bf16_last: fraction of the layers chosen for conversion, the last ones in
            model order, kept in bfloat16 instead (rounded up; 0 keeps none).
        seed: first seed of the layers' stochastic rounding and Hadamard signs
            (layer ``i`` uses ``seed + i``).
    """

    format: BlockFormat
    scale_mode: ScaleMode = "rceil"
    weight_2d: bool = False
    stochastic_rounding: bool = False
    hadamard: bool = False
    bf16_last: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.format, BlockFormat):
            raise type_error(
                "format is a BlockFormat (see amped.lowp.mx.block_format.BLOCK_FORMATS)",
                "format",
                self.format,
            )
        if self.scale_mode not in SCALE_MODES:
            raise value_error(f"scale_mode is one of {SCALE_MODES}", "scale_mode", self.scale_mode)
        if self.weight_2d and self.format.is_mx:
            raise value_error(
                "16x16 weight tiles are NVFP4's; MX formats scale 1x32 blocks",
                "format",
                self.format.name,
            )
        if self.stochastic_rounding and not self.format.is_fp4:
            raise value_error(
                "Stochastic rounding is for E2M1 (FP4) formats", "format", self.format.name
            )
        if not 0.0 <= self.bf16_last < 1.0:
            raise value_error("bf16_last is a fraction in [0, 1)", "bf16_last", self.bf16_last)

    def replace(self, **changes: object) -> BlockConfig:
        """A copy with ``changes`` (e.g. ``hadamard=False``), checked again."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def __str__(self) -> str:
        parts = [self.format.name]
        if self.format.is_mx:
            parts.append(self.scale_mode)
        flags = {
            "w2d": self.weight_2d,
            "sr": self.stochastic_rounding,
            "rht": self.hadamard,
        }
        parts += [name for name, on in flags.items() if on]
        if self.bf16_last:
            parts.append(f"bf16_last={self.bf16_last:g}")
        return ",".join(parts)


BLOCK_CONFIGS: dict[str, BlockConfig] = {
    "mxfp8": BlockConfig(BLOCK_FORMATS["mxfp8"]),
    "mxfp4": BlockConfig(BLOCK_FORMATS["mxfp4"]),
    "nvfp4": BlockConfig(
        BLOCK_FORMATS["nvfp4"],
        weight_2d=True,
        stochastic_rounding=True,
        hadamard=True,
        bf16_last=0.15,
    ),
}
"""The block recipes' configs by name."""
