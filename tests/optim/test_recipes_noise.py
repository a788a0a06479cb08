"""The optimizers' random bits (amped.optim.noise): lowbias32 of counters, in int32.

The hash is checked bitwise against the same function written in int64 with no
wrapping (tests/optim/test_recipes_compensated_reference.py has it), at odd lengths and
across the int32 wrap; its bits are checked for uniformity and for independence
between neighbouring elements and neighbouring keys.
"""

from __future__ import annotations

import pytest
import torch
from test_recipes_compensated_reference import _ref_noise
from tolerances import SR_SIGMAS

from amped.optim.noise import draw_keys, hashed_noise_


def _noise(start, numel):
    counters = torch.arange(numel, dtype=torch.int32)
    out, scratch = torch.empty_like(counters), torch.empty_like(counters)
    return hashed_noise_(out, counters, torch.tensor(start, dtype=torch.int32), scratch)


@pytest.mark.parametrize(
    "start", [0, 12345, 2**31 - 40, -(2**31)], ids=["zero", "small", "wraps", "most-negative"]
)
@pytest.mark.parametrize("numel", [1, 17, 1000])  # vector tails and bodies
def test_hash_is_lowbias32s_top_bits(start, numel):
    expected = _ref_noise(start % 2**32, 0, (numel,), "cpu")
    assert torch.equal(_noise(start, numel), expected)


N = 1 << 20


def test_bits_are_uniform_in_16_bits():
    """A chi-square over 256 bins of the top and the bottom 8 bits: 255 degrees of
    freedom, mean 255, standard deviation sqrt(2 * 255)."""
    noise = _noise(987654, N).long()
    assert noise.min() >= 0 and noise.max() < 1 << 16
    for bins in (noise >> 8, noise & 0xFF):
        counts = torch.bincount(bins, minlength=256).double()
        chi2 = ((counts - N / 256) ** 2 / (N / 256)).sum().item()
        assert abs(chi2 - 255) < SR_SIGMAS * (2 * 255) ** 0.5


def test_neighbours_are_uncorrelated():
    """The correlation of uniform noise with its neighbour (next element, or next key)
    has standard deviation 1 / sqrt(N) if they are independent."""
    noise = _noise(5, N + 1).double()
    shifted = _noise(6, N).double()
    for a, b in ((noise[:-1], noise[1:]), (noise[:-1], shifted)):
        correlation = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
        assert abs(correlation) < SR_SIGMAS / N**0.5


def test_keys_are_one_draw_of_the_generator():
    generator = torch.Generator().manual_seed(3)
    keys = draw_keys(3, generator)
    expected = torch.empty(3, dtype=torch.int32).random_(generator=torch.Generator().manual_seed(3))
    assert keys.dtype is torch.int32 and torch.equal(keys, expected)
    assert (keys >= 0).all()
