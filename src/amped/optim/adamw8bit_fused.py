"""The fused step of :class:`~amped.optim.adamw8bit.CompensatedAdamW8bit`: one kernel a tensor.

The eager 8-bit step (:mod:`amped.optim.adamw8bit`) runs about forty torch ops over
each parameter: dequantize both moments, ``lerp``, quantize (a block maximum, the
code computed from each value and one threshold lookup), the update and the
stochastic rounding. Here the same ops are one function of a range of whole blocks
of the parameter (its gradient, weight and codes viewed as ``(blocks, BLOCK)``, and its
scales), compiled with
``torch.compile(dynamic=True)`` through :func:`amped.optim.fused.run` (the
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
(docs/decisions/007-8bit-state.md). The moments are decoded by arithmetic
(:func:`amped.optim.quantized_state.decode`, equal to the map on every code), not
by a lookup in the map, which Inductor compiles to a scalar loop per vector.

Covered: bfloat16 parameters whose moments are quantized, under stochastic rounding.
The rest (small tensors, Kahan, float32 and float16 parameters) steps eagerly.

Numerics: the eager step's float32 ops in its order, with its random bits, and the
same bits come out (``tests/optim/test_recipes_8bit_fused.py`` checks weights, codes and
scales): the eager step rounds every operation on its own as Inductor's C++ does
(``lerp`` written as ``m + w * (g - m)``, no ``add(alpha=)``, whose eager kernels fuse
a multiply-add) and takes a correctly rounded square root, as the kernel's is.
"""

from __future__ import annotations

import torch

from amped.optim import fused
from amped.optim.fused import _canonical, _noise, _stochastic
from amped.optim.quantized_state import decode, encode

__all__ = ["adamw8bit_"]

_MIN_SCALE = 1e-12


def _quantize(
    blocks: torch.Tensor,
    thresholds: torch.Tensor,
    signed: bool,
    codes: torch.Tensor,
    scale: torch.Tensor,
) -> None:
    """:func:`amped.optim.quantized_state.quantize` of ``blocks`` (``(n, BLOCK)``),
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
    beta2**step)``, eps, ``-lr / (1 - beta1**step)``, AdamW's ``-lr * weight_decay``, the
    bound on ``m / (sqrt(v_hat) + eps)`` (inf: none; see
    :func:`amped.optim.adamw8bit.step_bound`)."""
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
    ratio = torch.clamp(avg / denom, min=-values[8], max=values[8])
    update = ratio * values[6] + values[7] * w
    value = _canonical(w + update)
    noise = _noise(value.numel(), start, value.device).view(value.shape)
    weight.copy_(_stochastic(value, torch.bfloat16, noise))


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
