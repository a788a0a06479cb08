"""Blockwise 8-bit quantization of optimizer state, with the dynamic map of bitsandbytes.

The 8-bit AdamW (:mod:`amped.recipes.adamw8bit`) keeps each moment of a large tensor as
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
(``tests/test_recipes_8bit.py`` checks). torchao finds the entry by a binary search in
the map (eight table lookups an element); here the code is computed from the value
(:func:`encode`): an estimate from its decade and its fraction, then one comparison
with a precomputed threshold, which gives the search's code on every float32
(``tests/test_recipes_8bit_encode.py`` checks every class of them). The eager and the
fused step (:mod:`amped.recipes.adamw8bit_fused`) run the same :func:`encode`. To read a
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
    (``tests/test_recipes_8bit_encode.py`` checks).

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


class _Level:
    """The constants of one stretch of magnitudes in :func:`encode`: from ``start`` (the
    entry at the top of the decade below, or 0) up to the next level's ``start``."""

    def __init__(self, signed: bool, k: int | None) -> None:
        qmap, cuts = dynamic_map(signed).tolist(), thresholds(signed).tolist()
        if k is None:  # from the top entry up to 1.0: the one pair (top entry, 1.0)
            self.size, self.base, self.decade, self.slope, self.intercept = 1, 255, 1.0, 0.0, 0.0
        else:  # decade k: 64 / 2**k centres (128 / 2**k unsigned) from code ``base`` on
            self.size = (64 if signed else 128) >> k
            self.base = 127 + self.size if signed else self.size - 1
            self.decade = _DECADES[k]
            # Centre j of the decade sits at 0.1 + 0.9 * (j + 0.5) / size times 10**-k.
            self.slope = self.size / (0.9 * 10.0**-k)
            self.intercept = -self.size / 9 - 0.5
        lowest = k == _EXPONENT_BITS - 1
        self.start = 0.0 if lowest else qmap[self.base - 1]
        # The level's first pair (the entry below ``base``, ``base``) as a magnitude
        # threshold: a positive value takes the upper code at ``x >= cuts[low]``; a
        # negative one, mirrored (codes 253 - low and 254 - low), the larger magnitude
        # where the smaller code holds: above ``-cuts[253 - low]``, so from the float
        # after it on. No negative code lies beyond the top entry.
        low = self.base - 1
        self.positive = cuts[low]
        self.negative = math.inf
        if signed and low < 254:
            above = torch.nextafter(torch.tensor(-cuts[253 - low]), torch.tensor(math.inf))
            self.negative = float(above)


def _levels(signed: bool) -> list[_Level]:
    """:class:`_Level` of each decade, lowest first, then the top pair's."""
    decades = [_Level(signed, k) for k in range(_EXPONENT_BITS - 1, -1, -1)]
    return [*decades, _Level(signed, None)]


# Built on import (a compiled kernel cannot read the tables while it traces encode).
_LEVELS = {signed: _levels(signed) for signed in (True, False)}


def encode(scaled: torch.Tensor, signed: bool) -> torch.Tensor:
    """The int32 code of each float32 in ``scaled`` (a value over its block's scale): the
    nearest map entry's index, as the search finds it, without a search or a lookup.

    The map (:func:`dynamic_map`) spends, per decade ``[10**-k / 10, 10**-k)`` (``k`` =
    0..6 from the top), ``n = 64 / 2**k`` entries (128 / 2**k unsigned) at the centres
    of ``n`` equal bins of ``linspace(0.1, 1, n + 1) * 10**-k``. A magnitude is placed in
    a *level* by comparisons with the entry at the top of each decade (so a level runs
    from the decade below's top entry to its own top entry; the last level, from the
    map's top entry to 1.0). Inside it, one multiply-add and a floor give ``lo``, the
    centre at or below the magnitude, or one off where the magnitude lies within float32
    error of a centre (there either neighbour pair gives the same code). Then the
    search's own rule decides between entries ``lo`` and ``lo + 1``: up where ``x -
    below >= (above - below) * 0.5`` in float32, with both entries computed as
    :func:`decode` computes them (three bin edges of the decade); the level's first pair
    (whose lower entry is the decade below's, or 0) has its threshold as a constant
    (from :func:`thresholds`). Negative values use the mirrored pair (the rule rounds
    ties up, towards the smaller magnitude there). Values beyond the map (above 1,
    below -1, infinities) take the end codes, NaN code 0, as in the search.

    Comparisons, selections and multiply-adds, which vectorize in a compiled kernel:
    equal to the search on every float32 (``tests/test_recipes_8bit_encode.py``).
    """
    magnitude = (scaled.abs() if signed else scaled.clamp(min=0.0)).clamp(max=1.0)
    levels = _LEVELS[signed]
    names = ["size", "base", "decade", "slope", "intercept", "positive"]
    if signed:
        names.append("negative")
    chosen = {name: torch.full_like(magnitude, getattr(levels[0], name)) for name in names}
    for level in levels[1:]:
        inside = magnitude >= level.start
        for name in names:
            chosen[name] = torch.where(inside, getattr(level, name), chosen[name])
    size = chosen["size"]
    lo = torch.floor(magnitude * chosen["slope"] + chosen["intercept"])
    lo = torch.minimum(lo.clamp(min=-1.0), size - 2.0)  # -1: the level's first pair
    width = 1.0 / size  # exact: a power of two
    fraction = lo * width
    edge = _bin_edge(fraction + width)
    below = chosen["decade"] * ((_bin_edge(fraction) + edge) / 2.0)
    above = chosen["decade"] * ((edge + _bin_edge(fraction + 2.0 * width)) / 2.0)
    half = (above - below) * 0.5
    if signed:
        negative = scaled < 0
        residual = torch.where(negative, above - magnitude, magnitude - below)
        inner = (residual >= half) != negative  # negative: up is the smaller magnitude
        first = magnitude >= torch.where(negative, chosen["negative"], chosen["positive"])
    else:
        inner = (magnitude - below) >= half
        first = magnitude >= chosen["positive"]
    up = torch.where(lo < 0.0, first, inner).to(torch.float32)
    code = chosen["base"] + lo + up
    if signed:
        code = torch.where(negative, 254.0 - code, code)
    return torch.where(scaled != scaled, 0.0, code).to(torch.int32)


def quantize(value: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``value`` (float32, ``quantizes(value.numel())``) as uint8 codes of its shape and
    float32 scales, one per block: each value over its block's scale, coded by
    :func:`encode` (the nearest map entry, up at a tie, as torchao's
    ``quantize_8bit_with_qmap``).
    """
    blocks = value.reshape(-1, BLOCK)
    scale = blocks.abs().amax(-1).clip(_MIN_SCALE)
    scaled = (blocks / scale.view(-1, 1)).reshape(-1)
    codes = encode(scaled, signed).to(torch.uint8)
    return codes.view(value.shape), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, signed: bool) -> torch.Tensor:
    """The float32 values that ``codes`` and ``scale`` stand for, shaped like ``codes``."""
    qmap = dynamic_map(signed, codes.device)
    values = qmap[codes.int()].view(scale.shape[0], -1) * scale.view(-1, 1)
    return values.view(codes.shape)
