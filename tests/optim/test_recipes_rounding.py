"""Kahan-compensated adds and stochastic rounding into bfloat16, against closed forms."""

from __future__ import annotations

import pytest
import torch
from tolerances import BITWISE, SR_SIGMAS

from amped.optim.rounding import draw_noise_, kahan_add_, rounded_with_noise_, stochastic_round_

BF16_ULP_AT_1 = 2.0**-7


def test_kahan_add_rounds_the_sum_once():
    g = torch.Generator().manual_seed(0)
    param = torch.randn(1000, generator=g).bfloat16()
    update = torch.randn(1000, generator=g) * 1e-2
    expected = (param.float() + update).bfloat16()
    kahan_add_(param, update.clone(), torch.zeros_like(param))
    torch.testing.assert_close(param, expected, **BITWISE)


def test_kahan_keeps_updates_far_below_half_an_ulp():
    # 1000 updates of 1e-4 to 1.0: each is 1/78 of a bfloat16 ulp at 1.0, so plain
    # bfloat16 never moves; the true sum is 1.1.
    naive = torch.ones(4, dtype=torch.bfloat16)
    param = torch.ones(4, dtype=torch.bfloat16)
    compensation = torch.zeros_like(param)
    for _ in range(1000):
        naive.add_(torch.full((4,), 1e-4))
        kahan_add_(param, torch.full((4,), 1e-4), compensation)
    assert (naive == 1.0).all()
    # Weight plus compensation tracks the sum. What it loses: each step stores the
    # compensation (at most half an ulp of the weight, 2**-8 relative) in bfloat16,
    # which keeps 2**-9 of it, so at most 2**-17 of the weight per step. Updates all
    # of one sign can add those up: the bound is linear in the steps, 0.0084 here,
    # against 0.1 lost by plain bfloat16.
    drift_bound = 1000 * 2.0**-17 * 1.1
    assert (param.float() + compensation.float() - 1.1).abs().max() < drift_bound
    assert (param.float() - 1.1).abs().max() < drift_bound + BF16_ULP_AT_1 / 2


def test_stochastic_rounding_is_unbiased():
    # 1 + 2**-9 lies a quarter of the way from 1.0 to the next bfloat16 (1 + 2**-7).
    n = 200_000
    value = torch.full((n,), 1 + 2.0**-9)
    out = torch.empty(n, dtype=torch.bfloat16)
    stochastic_round_(out, value, torch.Generator().manual_seed(0))
    assert set(out.float().unique().tolist()) == {1.0, 1 + BF16_ULP_AT_1}
    # Binomial: the mean's standard deviation is ulp * sqrt(p (1 - p) / n).
    sigma = BF16_ULP_AT_1 * (0.25 * 0.75 / n) ** 0.5
    assert abs(out.float().mean().item() - (1 + 2.0**-9)) < SR_SIGMAS * sigma
    negative = torch.empty(n, dtype=torch.bfloat16)
    stochastic_round_(negative, -value, torch.Generator().manual_seed(0))
    torch.testing.assert_close(negative, -out, **BITWISE)


def test_stochastic_rounding_keeps_exact_values_and_specials():
    value = torch.tensor([0.0, -0.0, 1.0, -2.5, 3e38, float("inf"), float("-inf"), float("nan")])
    value = value.bfloat16().float()
    out = torch.empty(len(value), dtype=torch.bfloat16)
    for seed in range(5):
        stochastic_round_(out, value, torch.Generator().manual_seed(seed))
        torch.testing.assert_close(out.float(), value, **BITWISE)


def test_stochastic_rounding_is_reproducible_with_a_seed():
    value = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    a, b = (torch.empty(1000, dtype=torch.bfloat16) for _ in range(2))
    stochastic_round_(a, value, torch.Generator().manual_seed(7))
    stochastic_round_(b, value, torch.Generator().manual_seed(7))
    torch.testing.assert_close(a, b, **BITWISE)
    # Every result is one of the two bfloat16 neighbours of the value.
    down = value.bfloat16().float()
    assert ((a.float() - value).abs() < (down - value).abs() + value.abs() * 2.0**-7).all()


def test_stochastic_rounding_refuses_other_dtypes():
    with pytest.raises(
        ValueError, match=r"implemented for bfloat16.*Received: dtype=torch.float16"
    ):
        stochastic_round_(torch.empty(2, dtype=torch.float16), torch.zeros(2), None)


# Bit patterns where the integer rounding could go wrong: NaNs whose high half carries
# into the sign bit (0x7FFFFFFF, CUDA's default NaN; 0xFFFFFFFF) or whose payload lies
# in the low half alone (0x7F800001, 0x7F80FFFF: truncated, they would read infinity),
# the default NaNs, infinities, the largest finite values (rounding up reaches
# infinity), zeros, subnormals and values whose low half is all ones.
EDGE_BITS = [
    0x7FFFFFFF,
    0xFFFFFFFF,
    0x7FC00000,
    0xFFC00000,
    0x7F800000,
    0xFF800000,
    0x7F800001,
    0xFF800001,
    0x7F80FFFF,
    0xFF80FFFF,
    0x7FBFFFFF,
    0x7F7FFFFF,
    0xFF7FFFFF,
    0x00000000,
    0x80000000,
    0x00000001,
    0x8000FFFF,
    0x3F80FFFF,
    0xBF808000,
]


def _float32(bits):
    signed = [b - (1 << 32) if b >= 1 << 31 else b for b in bits]
    return torch.tensor(signed, dtype=torch.int32).view(torch.float32)


def test_stochastic_rounding_of_edge_bit_patterns_for_every_noise():
    """Every noise value in [0, 2**16) for each pattern: a NaN stays a NaN, and any other
    value becomes high half + carry of (bits + noise), the unsigned sum truncated: one of
    its two bfloat16 neighbours, with its sign, infinities staying themselves."""
    noise = torch.arange(1 << 16, dtype=torch.int32)
    for bits in EDGE_BITS:
        value = _float32([bits]).expand(1 << 16).clone()
        rounded = rounded_with_noise_(value.clone(), noise.clone())
        out = torch.empty(1 << 16, dtype=torch.bfloat16)
        out.copy_(rounded)
        if value[0].isnan():
            assert rounded.isnan().all() and out.isnan().all(), hex(bits)
            continue
        truncated = (bits + noise.long()) & 0xFFFF0000  # as unsigned: never wraps here
        expected = _float32(truncated.tolist())
        assert torch.equal(rounded, expected), hex(bits)
        assert torch.equal(out.float(), expected), hex(bits)
        assert (expected.signbit() == value.signbit()).all(), hex(bits)
        if value[0].isinf():
            assert torch.equal(out.float(), value), hex(bits)


def test_stochastic_round_keeps_nans_and_leaves_its_input_alone():
    value = _float32(EDGE_BITS)
    before = value.clone()
    out = torch.empty(len(EDGE_BITS), dtype=torch.bfloat16)
    for seed in range(20):
        stochastic_round_(out, value, torch.Generator().manual_seed(seed))
        assert torch.equal(out.isnan(), value.isnan())
        finite = ~value.isnan()
        assert (out.float()[finite].signbit() == value[finite].signbit()).all()
    assert torch.equal(value.view(torch.int32), before.view(torch.int32))


def test_draw_noise_is_randint():
    """The optimizers draw into work tensors; the stream must be randint's."""
    a, b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for shape in [(5, 7), (0,), (), (1000,)]:
        expected = torch.randint(0, 1 << 16, shape, dtype=torch.int32, generator=a)
        got = draw_noise_(torch.empty(shape, dtype=torch.int32), b)
        assert torch.equal(got, expected)
        assert torch.equal(a.get_state(), b.get_state())
