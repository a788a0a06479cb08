"""Blockwise 8-bit quantization of optimizer state, with the dynamic map of bitsandbytes.

The 8-bit AdamW (:mod:`amped.optim.adamw8bit`) keeps each moment of a large tensor as
one byte per element plus one float32 scale per block of :data:`BLOCK` elements: 1.016
bytes an element. The method is Dettmers et al.'s (https://arxiv.org/abs/2110.02861),
as bitsandbytes and torchao's ``AdamW8bit`` implement it, with their constants:

- The flat tensor is cut into blocks of :data:`BLOCK` (256) elements; each block's scale
  is its largest magnitude (at least 1e-12), so that the scaled values lie in [-1, 1].
- A scaled value is stored as the index (code) of the nearest entry of a 256-entry
  table, the *dynamic map* (:func:`dynamic_map`): a float format whose exponent is
  counted in leading zero bits, so that it spans 7 decades (1e-7 to 1) with more
  fraction bits near 1. The first moment takes the signed map, the second moment
  (never negative) the unsigned one, which spends the sign bit on one more bit of
  fraction. Ties round to the upper entry.
- Only tensors of at least :data:`MIN_QUANTIZED` (4096) elements whose size is a
  multiple of :data:`BLOCK` are quantized (:func:`quantizes`): the rule of torchao (and,
  for the size, of bitsandbytes). Smaller ones (norms, biases) hold a small part of a
  model's elements, and their state stays float32.

The codes and the map are those of torchao 0.18's ``AdamW8bit`` bit for bit
(``tests/optim/test_recipes_8bit.py`` checks). torchao finds the entry by a binary search in
the map (eight table lookups an element); here the code is computed from the value
(:func:`encode`): an estimate from its decade and its fraction, then one comparison
with a precomputed threshold, which gives the search's code on every float32
(``tests/optim/test_recipes_8bit_encode.py`` checks every class of them). The eager and the
fused step (:mod:`amped.optim.adamw8bit_fused`) run the same :func:`encode`. To read a
code back, the eager step indexes the map; the fused step computes the entry
(:func:`decode`: a compiled kernel turns each table lookup into a scalar loop), which
equals the map on all 256 codes of both maps (the same test file checks), so both read
the same values.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "BLOCK",
    "MIN_QUANTIZED",
    "decode",
    "dequantize",
    "dynamic_map",
    "encode",
    "quantize",
    "quantizes",
    "thresholds",
]

BLOCK = 256
MIN_QUANTIZED = 4096
_MIN_SCALE = 1e-12  # an all-zero block keeps a finite scale: its codes decode to 0
_EXPONENT_BITS = 7  # decades of the map: 10**-6 .. 10**0 times fractions in [0.1, 1]

_MAPS: dict[tuple[bool, torch.device], torch.Tensor] = {}
_THRESHOLDS: dict[tuple[bool, torch.device], torch.Tensor] = {}


def quantizes(numel: int) -> bool:
    """Whether a tensor of ``numel`` elements keeps 8-bit state (else float32)."""
    return numel >= MIN_QUANTIZED and numel % BLOCK == 0


def dynamic_map(signed: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 256 float32 values the codes stand for, ascending: bitsandbytes'
    ``create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)`` without its zero
    padding, as torchao builds it (the same float32 arithmetic, so the same values)."""
    key = (signed, torch.device(device))
    if key not in _MAPS:
        values: list[float] = []
        for i in range(_EXPONENT_BITS):
            items = 2**i + 1 if signed else 2 ** (i + 1) + 1
            bounds = torch.linspace(0.1, 1, items)
            means = (bounds[:-1] + bounds[1:]) / 2.0
            decade = 10 ** (-(_EXPONENT_BITS - 1) + i)
            values += (decade * means).tolist()
            if signed:
                values += (-decade * means).tolist()
        values += [0.0, 1.0]
        values.sort()
        _MAPS[key] = torch.tensor(values, dtype=torch.float32, device=key[1])
    return _MAPS[key]


# The map's bins: torch.linspace(0.1, 1, m + 1) in float32, which torch (2.13, CPU)
# computes as ``start + step * j`` below the middle and ``end - step * (m - j)`` above
# it, each rounded once (a multiply-add), with ``step = (1 - 0.1) / m``. For ``m`` a
# power of two and ``t = j / m`` (7 significant bits at most) those are the exact
# values ``0.1 + span * t`` and ``(1 - span) + span * t``, with 0.1 and ``span = 1 -
# 0.1`` in float32. :func:`_bin_edge` rounds them once, in float32 alone: ``span`` and
# each start are cut into a high part on a coarse grid and a low rest, so that every
# product and every partial sum is exact.
_SPAN = float(torch.tensor(1.0) - torch.tensor(0.1))  # 1 - 0.1 in float32
_STARTS = (float(torch.tensor(0.1)), 1.0 - _SPAN)  # below and above the middle


def _cut(value: float, grid: float) -> tuple[float, float]:
    """``value`` as a multiple of ``grid`` plus a small rest (both exact floats here)."""
    high = math.floor(value / grid) * grid
    return high, value - high


_SPAN_HIGH, _SPAN_LOW = _cut(_SPAN, 2.0**-12)  # 12 bits; 1638 * 2**-24
_START_CUTS = [_cut(start, 2.0**-19) for start in _STARTS]  # on span_high * t's grid
_DECADES = [float(torch.tensor(10.0**-k)) for k in range(_EXPONENT_BITS)]  # float32, top first


def _bin_edge(fraction: torch.Tensor) -> torch.Tensor:
    """``torch.linspace(0.1, 1, m + 1)[j]`` for float32 ``fraction = j / m`` (``m`` a
    power of two up to 128), rounded once as torch rounds it.

    ``(start_high + SPAN_HIGH * t) + (start_low + SPAN_LOW * t)``: ``SPAN_HIGH * t`` has
    19 significant bits and ``SPAN_LOW * t`` 18, so both are exact; the first sum is a
    multiple of 2**-19 in [0, 1] and the second a multiple of 2**-31 below 2**-13, both
    exact; the last addition is the one rounding. (A compiler that fuses a multiply and
    an add changes nothing: every product is exact.)
    """
    upper = fraction >= 0.5
    (low_high, low_low), (up_high, up_low) = _START_CUTS
    start_high = torch.where(upper, up_high, low_high)
    start_low = torch.where(upper, up_low, low_low)
    return (start_high + _SPAN_HIGH * fraction) + (start_low + _SPAN_LOW * fraction)


def decode(codes: torch.Tensor, signed: bool) -> torch.Tensor:
    """The float32 map entry (:func:`dynamic_map`) of each code (integers 0..255, of any
    dtype), computed, not looked up: equal to the table on all 256 codes of both maps
    (``tests/optim/test_recipes_8bit_encode.py`` checks).

    Counted from the map's zero, the ``r``-th entry (``r`` = 1, 2, ...) lies in the
    decade of ``m`` entries (a power of two: 1..64 signed, 2..128 unsigned) with ``m <=
    r < 2 m``, as its ``j = r - m``-th: ``10**-k`` (``k`` from the top) times the centre
    of bin ``j`` of ``linspace(0.1, 1, m + 1)``, in float32 as :func:`dynamic_map`
    builds it; the entry past the last is 1.0, negative codes mirror positive ones.
    Six comparisons find the decade, :func:`_bin_edge` the bin's edges: selections and
    multiply-adds, which a compiled kernel vectorizes (a table lookup there is a
    scalar loop).
    """
    code = codes.to(torch.float32)
    rank = (code - 127.0).abs() if signed else code + 1.0
    lowest = 1 if signed else 2  # entries in the lowest decade
    size = torch.full_like(rank, float(lowest))
    decade = torch.full_like(rank, _DECADES[-1])
    for k in range(1, _EXPONENT_BITS):
        upper = rank >= float(lowest << k)
        size = torch.where(upper, float(lowest << k), size)
        decade = torch.where(upper, _DECADES[-1 - k], decade)
    width = 1.0 / size  # a bin's width, as a fraction of the decade: exact
    fraction = (rank - size) * width
    centre = (_bin_edge(fraction) + _bin_edge(fraction + width)) / 2.0
    value = decade * centre
    if signed:
        value = torch.where(code < 127.0, -value, value)
    value = torch.where(code == (127.0 if signed else 0.0), 0.0, value)
    return torch.where(code == 255.0, 1.0, value)


def thresholds(signed: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 255 float32 values where the code steps up: a value ``x`` with ``low``, the
    last map entry at or below it, takes code ``low + 1`` exactly when ``x >=
    thresholds[low]``.

    The search's rule (torchao's ``quantize_8bit_with_qmap``) rounds ``x`` up from entry
    ``low`` when ``x - below >= (above - below) * 0.5`` in float32. ``x - below`` grows
    with ``x``, so for each pair of entries that rule holds from one float32 on: found
    here by starting at the midpoint and stepping to the neighbouring floats. So ties
    (and the float32 roundings of the difference) go exactly as in the search.
    """
    key = (signed, torch.device(device))
    if key not in _THRESHOLDS:
        qmap = dynamic_map(signed, "cpu")
        below, above = qmap[:-1], qmap[1:]
        half = (above - below) * 0.5
        threshold = below + half
        lower = torch.full_like(threshold, -math.inf)
        higher = torch.full_like(threshold, math.inf)
        for _ in range(4):  # within an ulp or two of the midpoint
            previous = torch.nextafter(threshold, lower)
            threshold = torch.where((previous - below) >= half, previous, threshold)
            following = torch.nextafter(threshold, higher)
            threshold = torch.where((threshold - below) >= half, threshold, following)
        _THRESHOLDS[key] = threshold.to(key[1])
    return _THRESHOLDS[key]


def _lines(signed: bool) -> list[tuple[float, float]]:
    """Per decade ``k`` (0..6 from the top), the slope and intercept of a magnitude's
    position in the map (see :func:`encode`), in double precision."""
    size = 64 if signed else 128  # entries in the top decade
    offset = 128 if signed else 0  # entries below the first positive one
    # offset - 1.5 + n * (y + 0.8) / 0.9, with y = a * 10**k and n = size / 2**k
    return [
        (size * 5**k / 0.9, offset - 1.5 + size * 0.8 / 2**k / 0.9) for k in range(_EXPONENT_BITS)
    ]


_LINES = {signed: _lines(signed) for signed in (True, False)}


def encode(scaled: torch.Tensor, thresholds: torch.Tensor, signed: bool) -> torch.Tensor:
    """The int32 code of each float32 in ``scaled`` (a value over its block's scale): the
    nearest map entry's index, as the search finds it, without a search.

    The map (:func:`dynamic_map`) spends, per decade ``[10**-k / 10, 10**-k)`` (``k`` =
    0..6 from the top), ``n = 64 / 2**k`` entries (128 / 2**k unsigned) at the centres
    of ``n`` equal bins, above ``offset`` entries (128 signed: the negatives and 0; 0
    unsigned) and below 1.0. So a magnitude ``a = y * 10**-k`` (``y`` in [0.1, 1)) lies
    at position ``offset - 1.5 + n * (y + 0.8) / 0.9`` of the map, counted in entries:
    a line per decade, chosen by comparing ``a`` with the powers of ten. The map's index
    is linear in ``y`` within a decade; between decades, and between 0 and the first
    entry, the line is off by at most 0.39 of an entry, and it is continuous across
    decades, so a comparison that picks the neighbouring decade for a value at its
    edge changes nothing; the float32 arithmetic adds about 1e-4. A negative value sits
    mirrored, at ``254 - position``. The position's floor is then the code or one less,
    and one comparison with the threshold above that entry (:func:`thresholds`)
    decides. Values beyond the map (above 1, below -1, infinities) and NaN take the
    end codes, as in the search (NaN: 0, as torchao's binary search gives it).

    Plain comparisons, selections and one multiply-add, which vectorize in a compiled
    kernel: no search, and no ``log10`` or ``pow`` to find the decade.
    """
    magnitude = scaled.abs() if signed else scaled.clamp(min=0.0)
    lines = _LINES[signed]
    below = magnitude < 0.1
    slope = torch.where(below, lines[1][0], lines[0][0])
    intercept = torch.where(below, lines[1][1], lines[0][1])
    for k in range(2, _EXPONENT_BITS):  # below 10**-6, the lowest decade's line
        below = magnitude < 10.0**-k
        slope = torch.where(below, lines[k][0], slope)
        intercept = torch.where(below, lines[k][1], intercept)
    position = magnitude * slope + intercept
    if signed:
        position = torch.where(scaled < 0, 254.0 - position, position)
    position = torch.where(position != position, 0.0, position).clamp(0.0, 254.0)
    low = position.to(torch.int64)  # the code or one less
    return low + (scaled >= thresholds[low]).to(torch.int64)


def quantize(value: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``value`` (float32, ``quantizes(value.numel())``) as uint8 codes of its shape and
    float32 scales, one per block: each value over its block's scale, coded by
    :func:`encode` (the nearest map entry, up at a tie, as torchao's
    ``quantize_8bit_with_qmap``).
    """
    blocks = value.reshape(-1, BLOCK)
    scale = blocks.abs().amax(-1).clip(_MIN_SCALE)
    scaled = (blocks / scale.view(-1, 1)).reshape(-1)
    codes = encode(scaled, thresholds(signed, value.device), signed).to(torch.uint8)
    return codes.view(value.shape), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, signed: bool) -> torch.Tensor:
    """The float32 values that ``codes`` and ``scale`` stand for, shaped like ``codes``."""
    qmap = dynamic_map(signed, codes.device)
    values = qmap[codes.int()].view(scale.shape[0], -1) * scale.view(-1, 1)
    return values.view(codes.shape)
