"""The fused step of :class:`~amped.recipes.adamw8bit.CompensatedAdamW8bit`: one kernel a tensor.

The eager 8-bit step (:mod:`amped.recipes.adamw8bit`) runs about forty torch ops over
each parameter: dequantize both moments, ``lerp``, quantize (a block maximum, the
code computed from each value and one threshold lookup), the update and the
stochastic rounding. Here the same ops are one function of a range of whole blocks
of the parameter (its gradient, weight and codes viewed as ``(blocks, BLOCK)``, and its
scales), compiled with
``torch.compile(dynamic=True)`` through :func:`amped.recipes.fused.run` (the
compensated optimizers' machinery: one compile per process, a warning and the eager
step where it cannot compile). It reads the bfloat16 gradient and weight and the
one-byte codes once and writes the weight, codes and scales once; Inductor keeps some
float32 intermediates in memory (about 22 bytes an element), so the optimizer calls it
on pieces of a large tensor. The caller passes the ``(blocks, BLOCK)`` views, not flat
tensors: from a flat tensor of symbolic size ``s`` the kernel's ``view(-1, BLOCK)`` has
``256 * (s // 256)`` elements, which Inductor cannot prove equal to ``s``, so it split
the kernel into block loops and flat loops with a modulo in every flat index, and
realized the map positions to a float32 buffer between them; with 2-D inputs every
loop has the same extent and the kernel is about a fifth faster
(docs/history/issue-27-memory.md, fifth pass). The moments are decoded by arithmetic
(:func:`amped.recipes.quantized_state.decode`, equal to the map on every code), not
by a lookup in the map, which Inductor compiles to a scalar loop per vector.

Covered: bfloat16 parameters under stochastic rounding, those whose moments are
quantized by :func:`_adamw8bit`, one call per tensor (or piece), and the small ones
(float32 moments, at least two elements) by :func:`_adamw_float_moments`, laid end to
end, one call per parameter group and step count (stepped one at a time, as
optimizer-in-backward does, one call each): on the encoder's 32 norms and biases the
eager step took 10.6 ms, one call per tensor 4.3 ms, one call for all about 1.1 ms. The rest (one
element, Kahan, float32 and float16 parameters, FSDP2 shards) steps eagerly.

Numerics: the eager step's float32 ops in its order, with its random bits, and the
same bits come out (``tests/test_recipes_8bit_fused.py`` checks weights, codes and
scales): the eager step rounds every operation on its own as Inductor's C++ does
(``lerp`` written as ``m + w * (g - m)``, no ``add(alpha=)``, whose eager kernels fuse
a multiply-add) and takes a correctly rounded square root, as the kernel's is.
"""

from __future__ import annotations

import torch

from amped.recipes import fused
from amped.recipes.fused import _canonical, _hashed, _noise, _plus, _stochastic
from amped.recipes.quantized_state import decode, encode

__all__ = ["adamw8bit_", "adamw_float_moments_"]

_MIN_SCALE = 1e-12


def _quantize(
    blocks: torch.Tensor,
    thresholds: torch.Tensor,
    signed: bool,
    codes: torch.Tensor,
    scale: torch.Tensor,
) -> None:
    """:func:`amped.recipes.quantized_state.quantize` of ``blocks`` (``(n, BLOCK)``),
    written into ``codes`` (``(n, BLOCK)``) and ``scale`` (``(n,)``): the same ops."""
    block_scale = blocks.abs().amax(-1, keepdim=True).clamp(min=_MIN_SCALE)
    codes.copy_(encode(blocks / block_scale, thresholds, signed))
    scale.copy_(block_scale.view(-1))


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, signed: bool) -> torch.Tensor:
    return decode(codes, signed) * scale.view(-1, 1)


def _adamw8bit(
    grad: torch.Tensor,
    weight: torch.Tensor,
    avg_codes: torch.Tensor,
    avg_scale: torch.Tensor,
    avg_sq_codes: torch.Tensor,
    avg_sq_scale: torch.Tensor,
    signed_thresholds: torch.Tensor,
    unsigned_thresholds: torch.Tensor,
    values: torch.Tensor,
    start: torch.Tensor,
) -> None:
    """One parameter's step (or a piece's): ``grad``, ``weight`` and the codes are
    ``(n, BLOCK)`` views, the scales ``(n,)``. ``values``: the
    gradient's sign (maximize), Adam's L2 decay, ``1 - beta1``, ``1 - beta2``, ``sqrt(1 -
    beta2**step)``, eps, ``-lr / (1 - beta1**step)``, AdamW's ``-lr * weight_decay``."""
    g = grad.float() * values[0]
    w = weight.float()
    g = g + values[1] * w  # add(weight, alpha=wd) under Adam's L2 form; 0 otherwise
    avg = _dequantize(avg_codes, avg_scale, True)
    avg_sq = _dequantize(avg_sq_codes, avg_sq_scale, False)
    avg = avg + values[2] * (g - avg)  # lerp(g, 1 - beta1)
    avg_sq = avg_sq + values[3] * (g * g - avg_sq)  # lerp(g.square(), 1 - beta2)
    _quantize(avg, signed_thresholds, True, avg_codes, avg_scale)
    _quantize(avg_sq, unsigned_thresholds, False, avg_sq_codes, avg_sq_scale)
    denom = avg_sq.sqrt() / values[4] + values[5]
    update = avg / denom * values[6] + values[7] * w
    value = _canonical(w + update)
    noise = _noise(value.numel(), start, value.device).view(value.shape)
    weight.copy_(_stochastic(value, torch.bfloat16, noise))


def _adamw_float_moments(
    grad: torch.Tensor,
    weight: torch.Tensor,
    avg: torch.Tensor,
    avg_sq: torch.Tensor,
    values: torch.Tensor,
    numbers: torch.Tensor,
    key: torch.Tensor,
) -> None:
    """The step of tensors too small to quantize, whose moments ``avg`` and ``avg_sq``
    are float32, all flat (one tensor or several laid end to end): the eager step's ops
    and roundings, as in :func:`_adamw8bit` without the codes. ``numbers``: each
    element's number in the optimizer's noise (int32), to which the step's ``key`` is
    added. The decay terms are skipped where their factor is 0, as the eager
    step skips them (``0 * inf`` would be NaN), and maximizing negates the gradient."""
    g = grad.float()
    g = torch.where(values[0] < 0, -g, g)  # neg_(): also flips a NaN's sign, as eager
    w = weight.float()
    g = _plus(g, w, values[1])  # grad + wd * weight under Adam's L2 form
    new_avg = avg + values[2] * (g - avg)
    new_avg_sq = avg_sq + values[3] * (g * g - avg_sq)
    avg.copy_(new_avg)
    avg_sq.copy_(new_avg_sq)
    denom = new_avg_sq.sqrt() / values[4] + values[5]
    update = _plus(new_avg / denom * values[6], w, values[7])  # AdamW's decay
    value = _canonical(w + update)
    weight.copy_(_stochastic(value, torch.bfloat16, _hashed(numbers + key)))


def adamw_float_moments_(strict: bool, args: tuple[torch.Tensor, ...]) -> bool:
    """Run :func:`_adamw_float_moments` compiled on ``args`` (see it); False where it
    cannot be compiled (``strict``: raise instead)."""
    who = "amped's CompensatedAdamW8bit"
    return fused.run(_adamw_float_moments, args[0].device.type, strict, args, (), who=who)


def adamw8bit_(strict: bool, args: tuple[torch.Tensor, ...]) -> bool:
    """Run :func:`_adamw8bit` compiled on ``args`` (see it); False where it
    cannot be compiled (``strict``: raise instead)."""
    device_type = args[0].device.type
    who = "amped's CompensatedAdamW8bit"
    # The one table lookup left, the encoder's clamped estimate into 255 thresholds, is
    # in range by construction: Inductor's per-lookup bounds check, which made each
    # lookup several times dearer, is left out.
    options = {"assert_indirect_indexing": False}
    return fused.run(_adamw8bit, device_type, strict, args, (), who=who, options=options)
