"""Random bits for the optimizers' stochastic rounding: counters run through a hash.

An optimizer step that rounds stochastically needs 16 random bits per element and
write. torch's CPU generator (Mersenne Twister) makes them one at a time on one core,
about 3 ns an element on the development machine: more than the rest of a
compensated AdamW step. Here the bits come from a counter-based generator instead:
the step draws one 31-bit key per write from the optimizer's ``torch.Generator``
(so its state is the whole random state, saved and restored as before), and element
``i`` of that write gets the top 16 bits of ``hash(key + i)``, in torch's elementwise
integer ops, which run vectorized and on every thread (about 1.3 ns an element on one
core). The elements of a step are counted across chunks and pieces, so how a step
cuts its parameters does not change the noise.

The hash is Chris Wellons' ``lowbias32`` (xorshift-multiply rounds, bias 0.17 against
an ideal 32-bit hash's 0.02), of which the top 16 bits are taken: those its last
xorshift leaves alone, so it is skipped.
Signed int32 arithmetic wraps (two's complement, in every torch backend), so the
multiplications are those of uint32; the right shifts of a signed int32 copy its
sign bit, so each is masked to the logical shift.
"""

from __future__ import annotations

import torch

__all__ = ["draw_keys", "hashed_noise_"]

_M1 = 0x7FEB352D
_M2 = 0x846CA68B - (1 << 32)  # the uint32 constant as the int32 with its bits


def draw_keys(count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` int32 keys in [0, 2**31) from ``generator``, on its device: one random_
    call, the step's only use of the generator."""
    keys = torch.empty(count, dtype=torch.int32, device=generator.device)
    return keys.random_(generator=generator)


def hashed_noise_(
    out: torch.Tensor, counters: torch.Tensor, start: torch.Tensor, scratch: torch.Tensor
) -> torch.Tensor:
    """Fill int32 ``out`` with ``hash(counters + start)`` >> 16: integers in [0, 2**16).

    Args:
        out: int32, the shape of ``counters``.
        counters: int32 element numbers (``arange``).
        start: a 0-dim int32 tensor, the write's key plus the first element's number.
        scratch: int32 of ``out``'s shape, overwritten.

    Returns:
        ``out``.
    """
    x = torch.add(counters, start, out=out)
    torch.bitwise_right_shift(x, 16, out=scratch).bitwise_and_(0xFFFF)
    x.bitwise_xor_(scratch).mul_(_M1)
    torch.bitwise_right_shift(x, 15, out=scratch).bitwise_and_(0x1FFFF)
    x.bitwise_xor_(scratch).mul_(_M2)
    return x.bitwise_right_shift_(16).bitwise_and_(0xFFFF)
