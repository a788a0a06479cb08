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
copies are bounded by the largest tensor, not the model. The optimizers of
:mod:`amped.optim.compensated` do the same arithmetic on chunks of parameters at
once, with the rounding step of :func:`stochastic_round_` (:func:`rounded_with_noise_`)
and random bits of their own (:mod:`amped.optim.noise`, faster than
:func:`draw_noise_`'s ``randint``).
"""

from __future__ import annotations

from typing import Literal

import torch

from amped._internal.errors import value_error

__all__ = ["Compensation", "kahan_add_", "stochastic_round_"]

Compensation = Literal["kahan", "stochastic"]
"""How an update too small for the low dtype survives: Kahan compensation or
stochastic rounding (:class:`amped.recipes.Recipe`'s ``compensation``)."""

_LOW_BITS = 1 << 16  # bfloat16 is the top 16 bits of a float32
_HIGH_MASK = -_LOW_BITS  # 0xFFFF0000 as an int32: clears the low 16 bits
_NAN, _INF = float("nan"), float("inf")


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
    # A weight at +-inf loses nothing (inf - inf would be a NaN compensation, which the
    # next step would add to the weight): it stays at +-inf, as in torch and the fused step.
    compensation.copy_(total.sub_(param).nan_to_num_(nan=0.0, posinf=_INF, neginf=-_INF))


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
    low 16 bits are zero and the carry never reaches them). A NaN stays a NaN (its
    sign and payload are not kept).

    The random integers are those of ``torch.randint(0, 2**16, value.shape,
    dtype=torch.int32, generator=generator)``, one draw per call.

    Args:
        target: a bfloat16 tensor of ``value``'s shape.
        value: float32 values (left unchanged).
        generator: the random stream (a seeded one makes training reproducible).
    """
    require_bfloat16(target.dtype)
    noise = torch.empty(value.shape, dtype=torch.int32, device=value.device)
    target.copy_(rounded_with_noise_(value.clone(), draw_noise_(noise, generator)))


def require_bfloat16(dtype: torch.dtype) -> None:
    """Refuse stochastic rounding into anything but bfloat16."""
    if dtype is not torch.bfloat16:
        raise value_error(
            "Stochastic rounding is implemented for bfloat16, whose bits are the top half "
            "of a float32's; use Kahan compensation for other dtypes",
            "dtype",
            dtype,
        )


def draw_noise_(noise: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Fill int32 ``noise`` with uniform integers in [0, 2**16), in place.

    The same draws as ``torch.randint(0, 2**16, noise.shape, dtype=torch.int32)`` from
    ``generator``, which is how randint fills the tensor it returns.
    """
    return noise.random_(0, _LOW_BITS, generator=generator)


def rounded_with_noise_(value: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """:func:`stochastic_round_`'s rounding, with the random integers drawn already.

    Args:
        value: float32 values; NaNs among them are replaced by the default NaN in place
            (0x7FC00000), all other values are left unchanged.
        noise: int32 noise in [0, 2**16) of ``value``'s shape, from :func:`draw_noise_`
            or :func:`amped.optim.noise.hashed_noise_` (consumed).

    Returns:
        ``noise``'s memory as float32: the rounded values, each a bfloat16 exactly, so
        that copying them into bfloat16 does not round again.
    """
    # Why NaNs are replaced first. On the bit pattern v (as an unsigned 32-bit number)
    # the rounding computes (v + n) & 0xFFFF0000 with n < 2**16: the high half of v,
    # plus one when the low half carries. Every non-NaN float32 has a high half of at
    # most 0x7F80 in magnitude (infinity, whose low half is 0, so it cannot carry), so
    # the carry can reach the exponent (rounding up to the next power of two, or past
    # the largest bfloat16 to infinity: the right neighbour) but never the sign bit:
    # the result is one of v's two bfloat16 neighbours. A NaN can go wrong two ways: a
    # high half of 0x7FFF or 0xFFFF (0x7FFFFFFF is CUDA's default NaN) carries into
    # the sign bit and comes out as -0.0 or 0.0, and a NaN whose payload lies in the
    # low half alone (0x7F800001) truncates to infinity. The default NaN 0x7FC00000
    # has a NaN high half and a zero low half, so it neither carries nor truncates to
    # anything but itself. nan_to_num is one pass (0.2 ns an element on the development
    # machine); isnan plus where, which kept the NaNs before, took two (2.4 ns) and
    # allocated. posinf and neginf are given so that infinities stay themselves.
    value.nan_to_num_(nan=_NAN, posinf=_INF, neginf=-_INF)
    return noise.add_(value.view(torch.int32)).bitwise_and_(_HIGH_MASK).view(torch.float32)
