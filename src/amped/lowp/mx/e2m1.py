"""FP4 E2M1 elements: rounding to the eight magnitudes, stochastic rounding, packing.

E2M1 (OCP MX spec; torch's ``float4_e2m1fn_x2`` holds two per byte) has one sign bit,
two exponent bits and one mantissa bit, no inf and no NaN. Its magnitudes, by code::

    code   0    1    2    3    4    5    6    7
    value  0   0.5   1   1.5   2    3    4    6

Round to nearest sends a value to the closer neighbour and a tie to the even code
(0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4); values past
6 saturate to 6. The casts round values with :mod:`amped.lowp.mx.element_round`; the codes
here are for storing them (:attr:`amped.lowp.mx.block_cast.BlockTensor.data`).

A code is stored in 4 bits: ``sign << 3 | code``. Two codes pack into a byte, the
element at an even index in the low nibble (torchao's ``pack_uint4`` order).
"""

from __future__ import annotations

import torch

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "pack_e2m1",
    "to_e2m1_codes",
    "unpack_e2m1",
]

E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The magnitudes, indexed by code."""


def _tie_bounds(device: torch.device) -> torch.Tensor:
    """Midpoints between neighbours; where the tie goes up (to an even code) the bound
    is moved one float32 ulp down, so that ``bucketize(right=False)`` sends the tie up."""
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    mid = (values[:-1] + values[1:]) / 2
    tie_goes_up = torch.arange(1, 8, device=device) % 2 == 0  # upper neighbour's code even
    lowered = torch.nextafter(mid, torch.tensor(float("-inf"), device=device))
    return torch.where(tie_goes_up, lowered, mid)


def _codes_of_magnitude(magnitude: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even codes (0..7) of non-negative float32 magnitudes; NaN -> 7."""
    codes = torch.bucketize(magnitude, _tie_bounds(magnitude.device), right=False)
    return torch.where(torch.isnan(magnitude), 7, codes).to(torch.uint8)


def to_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes (``sign << 3 | code``, in uint8) of float32 ``x`` rounded to
    nearest-even, saturating at 6."""
    x = x.to(torch.float32)
    sign = torch.signbit(x).to(torch.uint8) << 3
    return sign | _codes_of_magnitude(x.abs())


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (last dim even) packed two per byte, as ``torch.float4_e2m1fn_x2``."""
    low, high = codes[..., 0::2], codes[..., 1::2]
    return (low | (high << 4)).view(torch.float4_e2m1fn_x2)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """float32 values of packed E2M1 data (last dim doubles)."""
    byte = packed.view(torch.uint8)
    codes = torch.stack([byte & 0xF, byte >> 4], dim=-1).flatten(-2)
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    magnitude = values[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -magnitude, magnitude)
