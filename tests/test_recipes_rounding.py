"""Kahan-compensated adds and stochastic rounding into bfloat16, against closed forms."""

from __future__ import annotations

import pytest
import torch

from amped.recipes.rounding import kahan_add_, stochastic_round_
from tolerances import BITWISE, SR_SIGMAS

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
