"""The verification rounds (amped.tuning.search): a bisection along the estimate's path
of plans, against a scripted verdict per plan (no training)."""

from __future__ import annotations

import math

import pytest

from amped.tuning.choose import Choice
from amped.tuning.search import search_path
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
        "index": 8, "layers": path[8].layers, "estimate": path[8].estimate,
        "gap": pytest.approx(0.5 * BUDGET), "passed": False, "completed": False,
    }  # fmt: skip
    assert found.choice is path[4]


def test_a_diverged_plan_fails_and_the_rounds_step_back() -> None:
    path = _path(5)
    gaps = {0: 0.0, 1: 0.0, 2: 0.0, 3: math.inf, 4: math.inf}
    train, seen = _trainer(gaps)
    found = search_path(path, 4, 10, train, REFERENCE, BUDGET)
    assert seen == [4, 2, 3]
    assert found.choice is path[2]
