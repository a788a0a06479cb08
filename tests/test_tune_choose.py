"""The choice (amped.tuning.choose): the knapsack against brute force, the first/last-N
rule against its definition, and the budget edge cases."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from amped.tuning.choose import RESOLUTION, SPEEDUPS, best_rule, choose_plan
from amped.tuning.measure import FormatMeasurement, LayerMeasurement

FORMATS = ("fp8-rowwise", "mxfp8", "nvfp4")


def _fm(cost: float) -> FormatMeasurement:
    return FormatMeasurement(
        sqnr_output=30.0,
        sqnr_grad_input=30.0,
        sqnr_grad_weight=30.0,
        loss_change_estimate=cost,
        loss_change_coherent=cost,
        loss_change_second_order=0.0,
        underflow=0.0,
        saturation=0.0,
    )


def _layers(rng: random.Random, count: int) -> list[LayerMeasurement]:
    return [
        LayerMeasurement(
            f"l{i}",
            rng.choice([1, 2, 4, 8]) * 10**6,
            {f: _fm(rng.uniform(0.0, 1.0)) for f in FORMATS if rng.random() < 0.85},
        )
        for i in range(count)
    ]


def _saving(layers: list[LayerMeasurement], plan: dict[str, str], target: str) -> float:
    speed = SPEEDUPS[target]
    return sum(m.flops * (1 - 1 / speed[plan[m.name]]) for m in layers)


def _cost(layers: list[LayerMeasurement], plan: dict[str, str]) -> float:
    return sum(
        m.formats[plan[m.name]].loss_change_estimate for m in layers if plan[m.name] != "bf16"
    )


def _brute_force(layers, budget: float, target: str) -> float:
    """The best saving over every plan whose costs, rounded up to budget/RESOLUTION
    units as the knapsack rounds them, fit the budget."""
    best = 0.0
    choices = [["bf16", *m.formats] for m in layers]
    for combo in itertools.product(*choices):
        plan = {m.name: f for m, f in zip(layers, combo, strict=True)}
        units = sum(
            math.ceil(m.formats[f].loss_change_estimate / budget * RESOLUTION)
            for m, f in zip(layers, combo, strict=True)
            if f != "bf16"
        )
        if units <= RESOLUTION:
            best = max(best, _saving(layers, plan, target))
    return best


@pytest.mark.parametrize("seed", range(6), ids=lambda s: f"instance{s}")
@pytest.mark.parametrize("target", ["blackwell", "hopper"])
def test_knapsack_finds_the_brute_force_optimum(seed: int, target: str) -> None:
    rng = random.Random(seed)
    layers = _layers(rng, 5)
    budget = rng.uniform(0.3, 2.0)
    choice = choose_plan(layers, budget, target)
    assert choice.estimate <= budget
    assert choice.saving == pytest.approx(_brute_force(layers, budget, target), rel=1e-12)
    assert choice.saving == pytest.approx(_saving(layers, choice.layers, target), rel=1e-12)
    assert choice.estimate == pytest.approx(_cost(layers, choice.layers), rel=1e-12)
    assert list(choice.layers) == [m.name for m in layers]


def test_hopper_never_chooses_a_format_without_a_speedup() -> None:
    layers = [LayerMeasurement("a", 10**6, {"nvfp4": _fm(0.0), "mxfp8": _fm(0.0)})]
    assert choose_plan(layers, 1.0, "hopper").layers == {"a": "bf16"}
    assert choose_plan(layers, 1.0, "blackwell").layers == {"a": "nvfp4"}


@pytest.mark.parametrize("budget", [0.0, 1e-9], ids=["zero", "tiny"])
def test_a_budget_nothing_fits_keeps_every_layer_in_bf16(budget: float) -> None:
    layers = _layers(random.Random(1), 4)
    choice = choose_plan(layers, budget, "blackwell")
    assert set(choice.layers.values()) == {"bf16"}
    assert choice.estimate == 0.0 and choice.saving == 0.0


def test_rule_is_the_best_first_last_n_rule_within_budget() -> None:
    rng = random.Random(3)
    layers = _layers(rng, 6)
    budget = 1.5
    rule = best_rule(layers, budget, "blackwell")
    assert rule.estimate <= budget
    assert rule.first is not None and rule.last is not None
    kept = [m.name for m in layers[: rule.first]] + [
        m.name for m in layers[len(layers) - rule.last :]
    ]
    assert all(rule.layers[name] == "bf16" for name in kept)
    assert {f for f in rule.layers.values()} <= {"bf16", rule.format}
    # Its definition, enumerated: no rule within budget saves more.
    for fmt in FORMATS:
        for first in range(len(layers) + 1):
            for last in range(len(layers) - first + 1):
                plan = {m.name: "bf16" for m in layers}
                for m in layers[first : len(layers) - last]:
                    if fmt in m.formats:
                        plan[m.name] = fmt
                if _cost(layers, plan) <= budget:
                    assert _saving(layers, plan, "blackwell") <= rule.saving + 1e-6
    # The knapsack searches a superset of the rules.
    assert choose_plan(layers, budget, "blackwell").saving >= rule.saving * (1 - 6 / RESOLUTION)
