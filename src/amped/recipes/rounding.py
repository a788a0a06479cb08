"""Writing a float32 value into low-precision storage without losing small updates.

bfloat16 keeps 8 significant bits, so adding an update smaller than half an ulp of
the weight (``|update| < |weight| * 2**-9``) rounds back to the old weight: with a
small learning rate, plain bfloat16 training stops learning. Two remedies:

- **Kahan compensation** (:func:`kahan_add_`): keep what the rounding lost in a
  low-precision buffer and add it to the next update. The weight plus its
  compensation carries about 16 significant bits; the buffer costs one extra
  low-precision value per weight.
- **Stochastic rounding** (:func:`stochastic_round_`): round up or down at random,
  with the probabilities that make the expected result exact. Unbiased, no extra
  memory, but noisy.

All arithmetic here is in float32, one tensor at a time, so the transient float32
copies are bounded by the largest tensor, not the model.
"""

from __future__ import annotations

import torch

__all__ = ["kahan_add_", "stochastic_round_"]

_LOW_BITS = 1 << 16  # bfloat16 is the top 16 bits of a float32
_HIGH_MASK = -_LOW_BITS  # 0xFFFF0000 as an int32: clears the low 16 bits


@torch.no_grad()
def kahan_add_(param: torch.Tensor, update: torch.Tensor, compensation: torch.Tensor) -> None:
    """``param += update`` in ``param``'s dtype, carrying the rounding error in ``compensation``.

    Args:
        param: the low-precision weight, updated in place.
        update: the float32 update (consumed: it may be overwritten).
        compensation: what earlier roundings lost, in ``param``'s dtype; updated in place.
    """
    # The update plus what earlier steps failed to add: two small numbers, summed
    # before they meet the weight, so neither is lost against it.
    wanted = update.add_(compensation)
    # The new weight in float32: exact but for bits below 2**-24 of the weight, where
    # the compensation (2**-9 of half an ulp, once stored) cannot see them anyway.
    total = param.to(torch.float32, copy=True).add_(wanted)
    param.copy_(total)  # rounds once, to nearest
    # What that rounding lost: exact in float32, since the rounded weight lies within
    # half an ulp of the total (Sterbenz). Stored in the low dtype, it keeps 8 bits.
    compensation.copy_(total.sub_(param))


@torch.no_grad()
def stochastic_round_(
    target: torch.Tensor, value: torch.Tensor, generator: torch.Generator | None
) -> None:
    """Write float32 ``value`` into bfloat16 ``target``, rounding stochastically.

    Adds uniform random integers in [0, 2**16) to the low 16 bits of each float32 and
    truncates them: a value a fraction ``f`` of the way from one bfloat16 to the next
    (in magnitude) rounds away from zero with probability ``f``, so the rounding is
    unbiased. Integer arithmetic on the bit pattern works for negative values too,
    since the sign bit sits apart from the magnitude bits, and keeps infinities (their
    low 16 bits are zero and the carry never reaches them). NaN passes through.

    Args:
        target: a bfloat16 tensor of ``value``'s shape.
        value: float32 values (left unchanged).
        generator: the random stream (a seeded one makes training reproducible).
    """
    if target.dtype is not torch.bfloat16:
        raise ValueError(
            "Stochastic rounding is implemented for bfloat16, whose bits are the top half "
            "of a float32's; use Kahan compensation for other dtypes. "
            f"Received: dtype={target.dtype}"
        )
    value = value.contiguous()
    bits = value.view(torch.int32)
    noise = torch.randint(
        0, _LOW_BITS, value.shape, dtype=torch.int32, device=value.device, generator=generator
    )
    rounded = noise.add_(bits).bitwise_and_(_HIGH_MASK).view(torch.float32)
    # A NaN's payload could carry into the sign bit and come out a number: keep NaNs.
    # Elsewhere the low 16 bits are zero now, so the copy into bfloat16 is exact.
    target.copy_(torch.where(value.isnan(), value, rounded))
