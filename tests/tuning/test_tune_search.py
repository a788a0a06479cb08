"""The verification rounds (amped.tuning.search): a bisection along the estimate's path
of plans, then the first/last-N rule candidates, against a scripted verdict per plan (no
training)."""

from __future__ import annotations

import math

import pytest

from amped.tuning.choose import Choice, rule_plans
from amped.tuning.measure import FormatMeasurement, LayerMeasurement
from amped.tuning.search import Candidate, search_path, search_rules
from amped.tuning.verify import Arm

BUDGET = 0.01
REFERENCE = Arm("bf16-mixed", {}, [1.0, 1.0])


def _path(length: int) -> list[Choice]:
    """Plans 0 .. length-1, plan i lowering the first i of ``length - 1`` layers."""
    names = [f"l{i}" for i in range(length - 1)]
    return [
        Choice({n: ("mxfp4" if k < i else "bf16") for k, n in enumerate(names)}, 0.001 * i, i)
        for i in range(length)
    ]


def _trainer(gaps: dict[int, float], completed: int | None = None):
    """A ``train`` whose arm for plan i has gap ``gaps[i]`` (incomplete from plan
    ``completed`` on, when given); records the plans asked for."""
    asked: list[int] = []

    def train(choice: Choice) -> Arm:
        index = int(choice.saving)
        asked.append(index)
        done = completed is None or index != completed
        losses = [1.0 + gaps[index]] * (2 if done else 1)
        return Arm("plan", dict(choice.layers), losses, completed=done)

    return train, asked


def _gaps(length: int, largest_passing: int) -> dict[int, float]:
    """Plans up to ``largest_passing`` pass, the larger ones fail."""
    return {i: (0.5 if i <= largest_passing else 2.0) * BUDGET for i in range(length)}


@pytest.mark.parametrize(
    ("start", "largest_passing", "asked"),
    [
        (4, 6, [4, 8, 6, 7]),  # passes, up halfway to the end, back down, up again
        (8, 2, [8, 4, 2, 3]),  # fails, down halfway to all-bf16, ...
        (12, 12, [12]),  # the last plan passes: nothing larger to try
        (1, 0, [1]),  # the first lowered plan fails: nothing smaller but all-bf16
    ],
    ids=["start-passes", "start-fails", "end-passes", "first-fails"],
)
def test_the_rounds_bisect_to_the_largest_passing_plan(start, largest_passing, asked) -> None:
    path = _path(13)
    train, seen = _trainer(_gaps(13, largest_passing))
    found = search_path(path, start, 10, train, REFERENCE, BUDGET)
    assert seen == asked
    assert [r["index"] for r in found.rounds] == asked
    assert [r["passed"] for r in found.rounds] == [i <= largest_passing for i in asked]
    if largest_passing > 0:
        assert found.choice is path[largest_passing]
        assert found.arm.passed(REFERENCE, BUDGET)
    else:  # none passed: the smallest tried, reported as failed
        assert found.choice is path[min(asked)]
        assert not found.arm.passed(REFERENCE, BUDGET)


def test_the_rounds_stop_at_their_bound_with_the_largest_plan_that_passed() -> None:
    path = _path(13)
    train, seen = _trainer(_gaps(13, 6))
    found = search_path(path, 4, 2, train, REFERENCE, BUDGET)
    assert seen == [4, 8]
    assert found.choice is path[4] and found.rounds[-1]["passed"] is False


def test_a_plan_cut_short_by_max_time_ends_the_rounds_and_does_not_pass() -> None:
    path = _path(13)
    train, seen = _trainer(_gaps(13, 12), completed=8)
    found = search_path(path, 4, 10, train, REFERENCE, BUDGET)
    assert seen == [4, 8]
    assert found.rounds[-1] == {
        "source": "estimate", "index": 8, "layers": path[8].layers,
        "estimate": path[8].estimate, "gap": pytest.approx(0.5 * BUDGET),
        "final_losses": [pytest.approx(1.0 + 0.5 * BUDGET)], "passed": False,
        "completed": False,
    }  # fmt: skip
    assert found.choice is path[4]


def test_a_diverged_plan_fails_and_the_rounds_step_back() -> None:
    path = _path(5)
    gaps = {0: 0.0, 1: 0.0, 2: 0.0, 3: math.inf, 4: math.inf}
    train, seen = _trainer(gaps)
    found = search_path(path, 4, 10, train, REFERENCE, BUDGET)
    assert seen == [4, 2, 3]
    assert found.choice is path[2]


# The built-in task of `amped compare` at budget 0.002 in MXFP4 (docs/benchmarks.md,
# docs/decisions/008): five layers of equal FLOPs, the estimate per layer as measured, and a
# scripted trained gap per plan near what training gave. The estimate calls l2 (1.linear1)
# costly; training finds it the cheapest.
NAMES = ["l0", "l1", "l2", "l3", "l4"]
ESTIMATE = {"l0": 2.7e-3, "l1": 1.0e-4, "l2": 2.8e-3, "l3": 7.0e-4, "l4": 2.0e-2}
TRAINED = {"l0": 2.5e-3, "l1": 2.2e-3, "l2": 0.6e-3, "l3": 1.9e-3, "l4": 0.38}


def _fm(estimate: float) -> FormatMeasurement:
    return FormatMeasurement(30.0, 30.0, 30.0, estimate, estimate, 0.0, 0.0, 0.0)


def _rules() -> list[Choice]:
    layers = [LayerMeasurement(n, 4, {"mxfp4": _fm(ESTIMATE[n])}) for n in NAMES]
    return rule_plans(layers, "blackwell")


def _rule_trainer(gaps: dict[frozenset[str], float]):
    """A ``train`` whose arm's gap is ``gaps`` of the lowered set (else the sum of the
    layers' TRAINED gaps); records the lowered sets asked for."""
    asked: list[set[str]] = []

    def train(choice: Choice) -> Arm:
        lowered = frozenset(n for n, f in choice.layers.items() if f != "bf16")
        asked.append(set(lowered))
        gap = gaps.get(lowered, sum(TRAINED[n] for n in lowered))
        return Arm("rule", dict(choice.layers), [1.0 + gap] * 2)

    return train, asked


def _plan(*lowered: str) -> dict[str, str]:
    return {n: ("mxfp4" if n in lowered else "bf16") for n in NAMES}


def test_rule_plans_are_every_distinct_rule_in_the_estimates_order() -> None:
    rules = _rules()
    assert len(rules) == 15  # the contiguous runs of 5 layers
    assert [r.estimate for r in rules] == sorted(r.estimate for r in rules)
    assert rules[0].layers == _plan("l1") and (rules[0].first, rules[0].last) == (1, 3)
    assert all(r.format == "mxfp4" for r in rules)


def test_a_rule_wins_where_every_plan_of_the_estimate_failed() -> None:
    # The estimate's rounds tried {l1, l3} and {l1}: both failed. Rules containing l1
    # are not tried; the others in the estimate's order until one passes, then those
    # of as many or more FLOPs; the passing rule with the smaller gap is kept.
    train, asked = _rule_trainer({})
    failed = [_plan("l1", "l3"), _plan("l1")]
    best, done = search_rules(_rules(), None, failed, failed, 4, train, REFERENCE, 0.002)
    assert asked == [{"l3"}, {"l0"}, {"l2"}, {"l2", "l3"}]
    assert [c.arm.passed(REFERENCE, 0.002) for c in done] == [True, False, True, False]
    assert isinstance(best, Candidate) and best.choice.layers == _plan("l2")
    assert best.source == "rule: first 2/last 2, mxfp4"
    assert best.arm.gap(REFERENCE) == pytest.approx(0.6e-3)


def test_only_rules_that_could_beat_the_estimates_plan_are_trained() -> None:
    # The estimate's plan {l1, l3} passed (2 layers); rules of one layer cannot beat it
    # and are never trained; {l2, l3} saves as much at a smaller gap and wins.
    measured = {frozenset({"l1", "l3"}): 4.6e-3, frozenset({"l1", "l2", "l3"}): 5.2e-3}
    train, asked = _rule_trainer(measured)
    kept = Choice(_plan("l1", "l3"), 8e-4, 6.0)  # each layer saves 4 * (1 - 1/4)
    estimate = Candidate("estimate", kept, train(kept))
    asked.clear()
    failed = [_plan("l0", "l1", "l3")]
    best, _ = search_rules(
        _rules(), estimate, [kept.layers, *failed], failed, 4, train, REFERENCE, 0.005
    )
    assert asked == [{"l0", "l1"}, {"l1", "l2"}, {"l2", "l3"}, {"l1", "l2", "l3"}]
    assert best is not None and best.choice.layers == _plan("l2", "l3")
    assert best.source == "rule: first 2/last 1, mxfp4"


def test_no_rule_is_trained_when_none_could_beat_the_plan() -> None:
    train, asked = _rule_trainer({})
    everything = Choice(_plan(*NAMES), 0.03, 15.0)
    estimate = Candidate("estimate", everything, Arm("plan", everything.layers, [1.0, 1.0]))
    best, done = search_rules(_rules(), estimate, [everything.layers], [], 4, train,
                              REFERENCE, 1.0)  # fmt: skip
    assert asked == [] and done == [] and best is estimate


def test_the_rule_candidates_stop_at_a_run_cut_short() -> None:
    def train(choice: Choice) -> Arm:
        return Arm("rule", dict(choice.layers), [1.0], completed=False)

    best, done = search_rules(_rules(), None, [], [], 4, train, REFERENCE, 1.0)
    assert best is None and len(done) == 1
