"""Block-scaled formats: MXFP8, MXFP4 (OCP Microscaling) and NVFP4, as values.

A block format stores a tensor as small elements, each block of ``block_size``
consecutive elements along the last dim sharing one scale:

============  ==============  =====  =====================================
format        elements        block  scale
============  ==============  =====  =====================================
mxfp8 (e4m3)  float8_e4m3fn    32    E8M0 power of two (``float8_e8m0fnu``)
mxfp8 (e5m2)  float8_e5m2      32    E8M0 power of two
mxfp4         E2M1 (fp4)       32    E8M0 power of two
nvfp4         E2M1 (fp4)       16    E4M3 block scale times a float32 tensor scale
============  ==============  =====  =====================================

MX scales are chosen by one of torchao's four rules (:data:`SCALE_MODES`), computed
from the block's largest magnitude ``amax`` and the element's largest power of two
``emax`` (8 for e4m3, 15 for e5m2, 2 for e2m1) or largest value ``max`` (448, 57344, 6):

- ``"floor"`` (OCP spec): ``2 ** (floor(log2(amax)) - emax)``; a block whose amax
  has a large mantissa saturates its largest elements;
- ``"ceil"``: ``2 ** (ceil(log2(amax)) - emax)``;
- ``"even"``: ``floor`` of amax first rounded to the element's mantissa width;
- ``"rceil"`` (NVIDIA cuBLAS, torchao's training default):
  ``2 ** ceil(log2(amax / max))``, the smallest power of two that never saturates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from amped._internal.errors import value_error

__all__ = ["BLOCK_FORMATS", "SCALE_MODES", "BlockFormat", "ScaleMode"]

ScaleMode = Literal["floor", "ceil", "even", "rceil"]
SCALE_MODES: tuple[ScaleMode, ...] = ("floor", "ceil", "even", "rceil")

E2M1 = torch.float4_e2m1fn_x2
_ELEMENTS = (torch.float8_e4m3fn, torch.float8_e5m2, E2M1)


@dataclass(frozen=True)
class BlockFormat:
    """One block-scaled format.

    Attributes:
        name: ``"mxfp8"``, ``"mxfp8-e5m2"``, ``"mxfp4"`` or ``"nvfp4"``.
        elem_dtype: ``float8_e4m3fn``, ``float8_e5m2`` or ``float4_e2m1fn_x2`` (E2M1).
        block_size: elements per scale along the last dim (32 MX, 16 NVFP4).
        scale_dtype: ``float8_e8m0fnu`` (MX) or ``float8_e4m3fn`` (NVFP4).
    """

    name: str
    elem_dtype: torch.dtype
    block_size: int
    scale_dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.elem_dtype not in _ELEMENTS:
            raise value_error(
                f"Block formats hold {', '.join(map(str, _ELEMENTS))} elements",
                "elem_dtype",
                self.elem_dtype,
            )

    @property
    def is_mx(self) -> bool:
        """E8M0 power-of-two scales (MXFP8, MXFP4); else NVFP4's E4M3 ones."""
        return self.scale_dtype is torch.float8_e8m0fnu

    @property
    def is_fp4(self) -> bool:
        return self.elem_dtype is E2M1

    @property
    def elem_max(self) -> float:
        """The element's largest finite magnitude."""
        return 6.0 if self.is_fp4 else float(torch.finfo(self.elem_dtype).max)

    @property
    def elem_emax(self) -> int:
        """The exponent of the element's largest power of two."""
        return {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15, E2M1: 2}[self.elem_dtype]

    @property
    def elem_mbits(self) -> int:
        return {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2, E2M1: 1}[self.elem_dtype]

    def __str__(self) -> str:
        return self.name


BLOCK_FORMATS: dict[str, BlockFormat] = {
    f.name: f
    for f in (
        BlockFormat("mxfp8", torch.float8_e4m3fn, 32, torch.float8_e8m0fnu),
        BlockFormat("mxfp8-e5m2", torch.float8_e5m2, 32, torch.float8_e8m0fnu),
        BlockFormat("mxfp4", E2M1, 32, torch.float8_e8m0fnu),
        BlockFormat("nvfp4", E2M1, 16, torch.float8_e4m3fn),
    )
}
"""The block formats by name."""
