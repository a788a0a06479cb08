"""Rounding to a small float element format (e4m3, e5m2, e2m1) inside a wider float.

The emulation never needs the elements' bits, only their values, and torch's CPU
conversions to and from ``float8_*`` are scalar loops (a float8 -> bfloat16 copy costs
several bfloat16 multiplies). So values are rounded in the compute dtype itself
(bfloat16 or float32) with vectorized arithmetic:

- **nearest-even**: the element's spacing (quantum) at ``|v|`` is
  ``q = max(2 ** (floor(log2 |v|) - mbits), 2 ** (emin - mbits))`` (the second term the
  subnormal spacing). With ``c = 1.5 * 2 ** p * q``, ``p`` the compute dtype's mantissa
  bits, ``|v| + c`` lies in a binade whose spacing is exactly ``q``, so the addition
  rounds ``|v|`` to a multiple of ``q``, ties to even, and ``(|v| + c) - c`` is that
  multiple, exactly. ``|v|`` is first clamped to the element's largest value, which
  saturates (and keeps ties below it from rounding past it).
- **stochastic**: ``floor(|v| / q + u) * q`` with ``u`` uniform in [0, 1): up with
  probability ``frac(|v| / q)`` (``|v| / q`` is exact: ``q`` is a power of two).

``floor(log2 |v|)`` comes from the exponent bits. Both are checked against torch's
casts and torchao's E2M1 rounding in tests/test_block_cast.py.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["ELEMENTS", "Element", "round_nearest_", "round_stochastic_"]


class Element(NamedTuple):
    """A float element format: largest value, mantissa bits, smallest normal exponent."""

    max: float
    mbits: int
    emin: int


ELEMENTS = {
    torch.float8_e4m3fn: Element(448.0, 3, -6),
    torch.float8_e5m2: Element(57344.0, 2, -14),
    torch.float4_e2m1fn_x2: Element(6.0, 1, 0),
}

# compute dtype -> (integer view, exponent mask, mantissa bits)
_LAYOUT = {
    torch.bfloat16: (torch.int16, 0x7F80, 7),
    torch.float32: (torch.int32, 0x7F800000, 23),
}


def _binade(v: torch.Tensor) -> torch.Tensor:
    """``2 ** floor(log2 |v|)`` for normal ``v`` (0 for zero and subnormals, inf for
    NaN), a new tensor: the exponent bits alone (the mask drops sign and mantissa)."""
    view, mask, _ = _LAYOUT[v.dtype]
    return (v.view(view) & mask).view(v.dtype)


def round_nearest_(v: torch.Tensor, element: Element) -> torch.Tensor:
    """``v`` (bfloat16 or float32) saturated and rounded to nearest-even ``element``
    values, in place (one temporary). NaN stays NaN.

    The constant takes ``v``'s sign, so the sum rounds the magnitude; the result takes
    it back from the constant (``x - x`` is +0, and a negative value that rounds to
    zero is -0, as a cast gives).
    """
    _, _, mantissa = _LAYOUT[v.dtype]
    v.clamp_(-element.max, element.max)
    ratio = 1.5 * 2.0 ** (mantissa - element.mbits)
    magic = _binade(v).mul_(ratio).clamp_(min=ratio * 2.0**element.emin).copysign_(v)
    return v.add_(magic).sub_(magic).copysign_(magic)


def round_stochastic_(
    v: torch.Tensor, element: Element, generator: torch.Generator | None
) -> torch.Tensor:
    """``v`` (float32) saturated and rounded stochastically to ``element`` values, in
    place; one uniform draw per element from ``generator``."""
    v.clamp_(-element.max, element.max)
    quantum = _binade(v).mul_(2.0**-element.mbits)
    quantum.clamp_(min=2.0 ** (element.emin - element.mbits)).copysign_(v)  # keeps v's sign
    draw = torch.rand(v.shape, generator=generator, device=v.device, dtype=v.dtype)
    v.div_(quantum).add_(draw).floor_()  # v / q = |v| / |q| >= 0
    return v.mul_(quantum)  # back to v's sign (a zero keeps it too: 0 * -q = -0)
