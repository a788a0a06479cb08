"""The fused step of :class:`~amped.recipes.adamw8bit.CompensatedAdamW8bit`: one kernel a tensor.

The eager 8-bit step (:mod:`amped.recipes.adamw8bit`) runs about twenty torch ops over
each parameter: dequantize both moments, ``lerp``, quantize (a block maximum, a
search in the map, a rounding), the update and the stochastic rounding. Here the same
ops are one function of the parameter's flat gradient, weight, codes and scales,
compiled with ``torch.compile(dynamic=True)`` through :func:`amped.recipes.fused.run`
(the compensated optimizers' machinery: one compile per process, a warning and the
eager step where it cannot compile). It reads the bfloat16 gradient and weight and the
one-byte codes once and writes the weight, codes and scales once.

Covered: bfloat16 parameters whose moments are quantized, under stochastic rounding.
The rest (small tensors, Kahan, float32 and float16 parameters) steps eagerly.

Numerics: the eager step's float32 ops in its order, with its random bits, so the
results differ only where Inductor's arithmetic does (see :mod:`amped.recipes.fused`:
eager ``lerp`` and ``add(alpha=)`` fuse a multiply-add, eager ``sqrt`` may differ by
an ulp): a float32 ulp of an intermediate, which rarely moves a code across a midpoint
or a weight across a bfloat16 rounding boundary (``tests/test_recipes_8bit_fused.py``).
"""

from __future__ import annotations

import torch

from amped.recipes import fused
from amped.recipes.fused import _canonical, _noise, _stochastic
from amped.recipes.quantized_state import BLOCK

__all__ = ["adamw8bit_"]

_MIN_SCALE = 1e-12


def _quantize(
    value: torch.Tensor, qmap: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor
) -> None:
    """:func:`amped.recipes.quantized_state.quantize` of flat ``value``, written into
    ``codes`` and ``scale``."""
    blocks = value.view(-1, BLOCK)
    block_scale = blocks.abs().amax(-1).clamp(min=_MIN_SCALE)
    scaled = (blocks / block_scale.view(-1, 1)).view(-1)
    # The last entry at or below each value: a branchless binary search (torchao's),
    # eight lookups in the 256-entry map, which the compiled kernel keeps in cache
    # (torch.bucketize took 150 ns an element on the development CPU).
    low = torch.where(scaled >= qmap[128], 128, 0)
    for step in (64, 32, 16, 8, 4, 2, 1):
        low = low + torch.where(scaled >= qmap[low + step], step, 0)
    high = (low + 1).clamp(max=255)
    below, above = qmap[low], qmap[high]
    up = (scaled - below) >= (above - below) * 0.5
    codes.copy_(torch.where(up, high, low).to(torch.uint8))
    scale.copy_(block_scale)


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    return (qmap[codes.int()].view(-1, BLOCK) * scale.view(-1, 1)).view(-1)


def _adamw8bit(
    grad: torch.Tensor,
    weight: torch.Tensor,
    avg_codes: torch.Tensor,
    avg_scale: torch.Tensor,
    avg_sq_codes: torch.Tensor,
    avg_sq_scale: torch.Tensor,
    signed_map: torch.Tensor,
    unsigned_map: torch.Tensor,
    values: torch.Tensor,
    start: torch.Tensor,
) -> None:
    """One parameter's step. ``values``: the gradient's sign (maximize), Adam's L2 decay,
    ``1 - beta1``, ``1 - beta2``, ``sqrt(1 - beta2**step)``, eps, ``-lr / (1 -
    beta1**step)``, AdamW's ``-lr * weight_decay``."""
    g = grad.float() * values[0]
    w = weight.float()
    g = g + values[1] * w  # add(weight, alpha=wd) under Adam's L2 form; 0 otherwise
    avg = _dequantize(avg_codes, avg_scale, signed_map)
    avg_sq = _dequantize(avg_sq_codes, avg_sq_scale, unsigned_map)
    avg = avg + values[2] * (g - avg)  # lerp(g, 1 - beta1)
    avg_sq = avg_sq + values[3] * (g * g - avg_sq)  # lerp(g.square(), 1 - beta2)
    _quantize(avg, signed_map, avg_codes, avg_scale)
    _quantize(avg_sq, unsigned_map, avg_sq_codes, avg_sq_scale)
    denom = avg_sq.sqrt() / values[4] + values[5]
    update = avg / denom * values[6] + values[7] * w
    value = _canonical(w + update)
    noise = _noise(value.shape[0], start, value.device)
    weight.copy_(_stochastic(value, torch.bfloat16, noise))


def adamw8bit_(strict: bool, args: tuple[torch.Tensor, ...]) -> bool:
    """Run :func:`_adamw8bit` compiled on ``args`` (flat tensors, see it); False where it
    cannot be compiled (``strict``: raise instead)."""
    device_type = args[0].device.type
    who = "amped's CompensatedAdamW8bit"
    return fused.run(_adamw8bit, device_type, strict, args, (), who=who)
