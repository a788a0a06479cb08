"""The choice (amped.tuning.choose): the estimate's path of plans against brute force,
the first/last-N rules against their definition, and the budget edge cases."""

from __future__ import annotations

import itertools
import random

import pytest

from amped.tuning.choose import SPEEDUPS, plan_path, rule_plans, within
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
    """The best saving over every plan whose summed estimate is within ``budget``."""
    best = 0.0
    choices = [["bf16", *m.formats] for m in layers]
    for combo in itertools.product(*choices):
        plan = {m.name: f for m, f in zip(layers, combo, strict=True)}
        if _cost(layers, plan) <= budget * (1 + 1e-12):
            best = max(best, _saving(layers, plan, target))
    return best


@pytest.mark.parametrize("seed", range(6), ids=lambda s: f"instance{s}")
@pytest.mark.parametrize("target", ["blackwell", "hopper"])
def test_every_plan_on_the_path_is_the_brute_force_optimum_at_its_estimate(
    seed: int, target: str
) -> None:
    layers = _layers(random.Random(seed), 5)
    path = plan_path(layers, target)
    assert set(path[0].layers.values()) == {"bf16"} and path[0].estimate == 0.0
    for choice in path:
        assert list(choice.layers) == [m.name for m in layers]
        assert choice.saving == pytest.approx(_saving(layers, choice.layers, target), rel=1e-12)
        assert choice.estimate == pytest.approx(_cost(layers, choice.layers), rel=1e-12)
        best = _brute_force(layers, choice.estimate, target)
        assert choice.saving == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("seed", range(4), ids=lambda s: f"instance{s}")
def test_the_path_moves_one_layer_at_a_time_to_more_saving(seed: int) -> None:
    layers = _layers(random.Random(seed), 6)
    path = plan_path(layers, "blackwell")
    for before, after in itertools.pairwise(path):
        changed = [n for n in before.layers if before.layers[n] != after.layers[n]]
        assert len(changed) == 1
        assert after.saving > before.saving and after.estimate >= before.estimate
    # The end lowers every layer with a format to a fastest one it can run.
    speed = SPEEDUPS["blackwell"]
    for m in layers:
        fastest = max((speed[f] for f in m.formats), default=1.0)
        assert speed[path[-1].layers[m.name]] == fastest


@pytest.mark.parametrize(
    ("budget", "expected"), [(0.0, 0), (0.25, 1), (0.5, 1), (0.75, 2), (10.0, 3)], ids=str
)
def test_within_is_the_last_plan_whose_estimate_fits(budget: float, expected: int) -> None:
    costs = {"a": 0.5, "b": 0.25, "c": 1.0}
    layers = [LayerMeasurement(n, 10**6, {"nvfp4": _fm(c)}) for n, c in costs.items()]
    path = plan_path(layers, "blackwell")
    assert [c.estimate for c in path] == [0.0, 0.25, 0.75, 1.75]  # cheapest per saving first
    assert within(path, budget) == expected


def test_hopper_never_chooses_a_format_without_a_speedup() -> None:
    layers = [LayerMeasurement("a", 10**6, {"nvfp4": _fm(0.0), "mxfp8": _fm(0.0)})]
    assert [c.layers for c in plan_path(layers, "hopper")] == [{"a": "bf16"}]
    assert plan_path(layers, "blackwell")[-1].layers == {"a": "nvfp4"}


def test_rule_plans_are_every_first_last_n_rule_once_in_the_estimates_order() -> None:
    rng = random.Random(3)
    layers = _layers(rng, 6)
    rules = rule_plans(layers, "blackwell")
    # Its definition, enumerated: each distinct lowered set of some rule, exactly once.
    expected = set()
    for fmt in FORMATS:
        for first in range(len(layers) + 1):
            for last in range(len(layers) - first + 1):
                plan = {m.name: "bf16" for m in layers}
                for m in layers[first : len(layers) - last]:
                    if fmt in m.formats:
                        plan[m.name] = fmt
                if any(f != "bf16" for f in plan.values()):
                    expected.add(tuple(plan.items()))
    got = [tuple(rule.layers.items()) for rule in rules]
    assert len(got) == len(set(got)) and set(got) == expected
    for rule in rules:
        assert rule.first is not None and rule.last is not None
        kept = [m.name for m in layers[: rule.first]] + [
            m.name for m in layers[len(layers) - rule.last :]
        ]
        assert all(rule.layers[name] == "bf16" for name in kept)
        assert {f for f in rule.layers.values()} <= {"bf16", rule.format}
        assert rule.estimate == pytest.approx(_cost(layers, rule.layers))
        assert rule.saving == pytest.approx(_saving(layers, rule.layers, "blackwell"))
    assert [r.estimate for r in rules] == sorted(r.estimate for r in rules)
