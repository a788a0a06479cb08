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
(``tests/test_recipes_8bit.py`` checks); the search runs as ``torch.bucketize`` rather
than torchao's unrolled binary search, which finds the same entry.
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "MIN_QUANTIZED", "dequantize", "dynamic_map", "quantize", "quantizes"]

BLOCK = 256
MIN_QUANTIZED = 4096
_MIN_SCALE = 1e-12  # an all-zero block keeps a finite scale: its codes decode to 0
_EXPONENT_BITS = 7  # decades of the map: 10**-6 .. 10**0 times fractions in [0.1, 1]

_MAPS: dict[tuple[bool, torch.device], torch.Tensor] = {}


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


def quantize(value: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``value`` (float32, ``quantizes(value.numel())``) as uint8 codes of its shape and
    float32 scales, one per block.

    The scaled value is placed between the two map entries around it and rounded to the
    nearer one (up at a tie), as torchao's ``quantize_8bit_with_qmap``.
    """
    qmap = dynamic_map(signed, value.device)
    blocks = value.reshape(-1, BLOCK)
    scale = blocks.abs().amax(-1).clip(_MIN_SCALE)
    scaled = (blocks / scale.view(-1, 1)).reshape(-1)
    # The last entry at or below each value (0 for a value below the first entry).
    low = torch.bucketize(scaled, qmap, right=True).sub_(1).clamp_(0, 255)
    high = (low + 1).clamp_(max=255)
    below, above = qmap[low], qmap[high]
    up = (scaled - below) >= (above - below) * 0.5
    codes = torch.where(up, high, low).to(torch.uint8)
    return codes.view(value.shape), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, signed: bool) -> torch.Tensor:
    """The float32 values that ``codes`` and ``scale`` stand for, shaped like ``codes``."""
    qmap = dynamic_map(signed, codes.device)
    values = qmap[codes.int()].view(scale.shape[0], -1) * scale.view(-1, 1)
    return values.view(codes.shape)
