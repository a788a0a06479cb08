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
  The draws ``u`` are not ``torch.rand``'s: :func:`hashed_uniform` makes them from a
  counter-based hash of a key (two 32-bit numbers drawn once per cast from the
  caller's generator, :func:`rounding_key`) and each element's row-major index, in
  integer arithmetic, so a compiled cast computes them in its own loop, with the
  eager bits (a ``torch.rand`` inside a compiled graph draws other numbers than
  eagerly, and an eager draw costs a pass of its own).

``2 ** floor(log2 |v|)`` comes from three multiplies and a subtraction (:func:`_binade`)
and the sign is put back by comparisons, so the rounding compiles to straight vector
code with no out-of-line calls. Both are checked against torch's
casts and torchao's E2M1 rounding in tests/lowp/mx/test_block_cast.py.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = [
    "ELEMENTS",
    "Element",
    "hashed_uniform",
    "round_nearest",
    "round_nearest_",
    "round_stochastic",
    "round_stochastic_",
    "rounding_key",
]


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

# compute dtype -> significant bits (float32 24, bfloat16 8), of which the mantissa's
_PRECISION = {torch.float32: 24, torch.bfloat16: 8}


def _binade(magnitude: torch.Tensor) -> torch.Tensor:
    """``2 ** floor(log2 m)`` of a magnitude ``m >= 0`` (Rump's "unit in the first
    place"), a new tensor.

    In floating-point arithmetic alone: ``q = (2 ** (p - 1) + 1) * m`` and
    ``q - (1 - 2 ** -p) * q`` (Rump, Ogita, Oishi 2008, algorithm 3.5, which takes
    ``|(1 - 2 ** -p) * q - q|``: the same number for ``m >= 0``, as a rounded
    subtraction is antisymmetric, without the ``abs``), ``p`` the dtype's significant
    bits; exact for normal ``m`` below about ``2 ** (127 - p)`` (through the rounding,
    tests/lowp/mx/test_block_cast.py checks every bfloat16 and float32 binades -30..16). Not the
    exponent bits of an integer view: Inductor's CPU code moves each element through
    memory for such a bit cast, which made the compiled cast three times slower. Zero
    gives zero, NaN NaN; values below the element's normal range may come out off by a
    binade, which the callers' clamp to the subnormal spacing hides.
    """
    p = _PRECISION[magnitude.dtype]
    q = magnitude * (2.0 ** (p - 1) + 1)
    return q - (1 - 2.0**-p) * q


def round_nearest(v: torch.Tensor, element: Element) -> torch.Tensor:
    """``v`` (bfloat16 or float32) saturated and rounded to nearest-even ``element``
    values, a new tensor. NaN stays NaN (of either sign).

    The magnitude is rounded (``|v| + c`` ties to even, as the sign does not matter
    there) and the sign put back by :func:`_with_sign_of`. Each step is one rounding of
    exact operands, so a compiler has nothing to contract or reorder: compiled and
    eager give the same bits (:mod:`amped.lowp.float8.compiled_cast` runs the block casts
    compiled, in float32).
    """
    mantissa = _PRECISION[v.dtype] - 1
    magnitude = v.abs().clamp(max=element.max)
    ratio = 1.5 * 2.0 ** (mantissa - element.mbits)
    magic = (_binade(magnitude) * ratio).clamp(min=ratio * 2.0**element.emin)
    return _with_sign_of(v, (magnitude + magic) - magic)


def _with_sign_of(v: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """``magnitude`` (>= 0, the rounded ``|v|``) with ``v``'s sign, as a cast gives it: a
    negative value that rounds to zero is -0, and a zero keeps its sign.

    Comparisons and a negation, not ``copysign``: Inductor's CPU code calls SLEEF's
    copysign out of line for every vector, which cost about a tenth of a cast.
    """
    return torch.where(v < 0, -magnitude, torch.where(v == 0, v, magnitude))


def round_nearest_(v: torch.Tensor, element: Element) -> torch.Tensor:
    """:func:`round_nearest` in place."""
    return v.copy_(round_nearest(v, element))


def round_stochastic(v: torch.Tensor, element: Element, draw: torch.Tensor) -> torch.Tensor:
    """``v`` (float32) saturated and rounded stochastically to ``element`` values with
    ``draw`` (uniform in [0, 1), ``v``'s shape), a new tensor."""
    magnitude = v.abs().clamp(max=element.max)
    quantum = _binade(magnitude) * 2.0**-element.mbits
    quantum = quantum.clamp(min=2.0 ** (element.emin - element.mbits))
    steps = torch.floor(magnitude / quantum + draw)  # |v| / q is exact: q a power of two
    return _with_sign_of(v, steps * quantum)


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (shift-xor-multiply rounds, after Wellons' "lowbias32") of
    int32 values, in int32 arithmetic modulo 2**32: products wrap (the low 32 bits of
    the product, as unsigned arithmetic gives them), and each right shift is masked to
    the bits a logical shift keeps."""
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * 0x7FEB352D
    h = h ^ ((h >> 15) & 0x1FFFF)
    h = h * 0x5BD1E995
    return h ^ ((h >> 16) & 0xFFFF)


def rounding_key(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """The key of one stochastic cast: two numbers in [0, 2**32) (int64), drawn from
    ``generator`` (advancing it; the default generator where None)."""
    where = device if generator is None else generator.device
    key = torch.randint(0, 1 << 32, (2,), generator=generator, dtype=torch.int64, device=where)
    return key.to(device)


def hashed_uniform(key: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Uniform float32 numbers in [0, 1), ``shape``, 24 random bits each: element ``i``
    (row-major) gets ``hash(hash(i mod 2**32 ^ key[0]) ^ (i >> 32) ^ key[1])``'s top 24
    bits. Pure integer arithmetic: the same bits eager and compiled, on every device.

    The hash runs on 32-bit integers (int32, wrapping), which a CPU's vector units
    multiply two to four times faster than int64, and gives the bits of the same hash
    in int64 arithmetic masked to 32 bits (tests/lowp/mx/test_block_properties.py)."""
    index = torch.arange(shape.numel(), dtype=torch.int64, device=key.device).view(shape)
    words = key.to(torch.int32)  # wraps: the same 32 bits
    h = _mix32(index.to(torch.int32) ^ words[0])  # i mod 2**32
    if shape.numel() > 1 << 32:  # else i >> 32 is 0 (the shape is static per kernel)
        h = h ^ (index >> 32).to(torch.int32)
    h = _mix32(h ^ words[1])
    return ((h >> 8) & 0xFFFFFF).to(torch.float32) * 2.0**-24


def round_stochastic_(
    v: torch.Tensor, element: Element, generator: torch.Generator | None
) -> torch.Tensor:
    """``v`` (float32) saturated and rounded stochastically to ``element`` values, in
    place; the draws :func:`hashed_uniform` of a :func:`rounding_key` from ``generator``."""
    draw = hashed_uniform(rounding_key(generator, v.device), v.shape)
    return v.copy_(round_stochastic(v, element, draw))
