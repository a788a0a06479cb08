"""The verification rounds: the estimate orders the plans, training decides how far along
that order to go (docs/tune.md, "How it verifies").

The plans are :func:`amped.tuning.choose.plan_path`'s, from all-bfloat16 (index 0, which
passes by definition: it is the reference arm) to every layer in its fastest format. The
first round trains the last plan within the budget by the estimate. Then a bisection: a
plan that passes becomes the lower end (nothing smaller need be tried), one that fails the
upper end (nothing larger), and the next round trains the plan halfway between them, until
they meet or ``rounds`` plans were trained. The result is the largest plan that passed;
when none did, the last (smallest) one tried, reported as failed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from amped.recipes.plan import PrecisionPlan
from amped.tuning.choose import Choice
from amped.tuning.verify import Arm, verify_arm

__all__ = ["Search", "search_path", "train_choice"]

Train = Callable[[Choice], Arm]


@dataclass(frozen=True)
class Search:
    """The outcome of the rounds: the chosen plan, its arm, and every round in turn
    (``{"index", "layers", "estimate", "gap", "passed", "completed"}``)."""

    choice: Choice
    arm: Arm
    rounds: list[dict[str, Any]]


def search_path(
    path: list[Choice], start: int, rounds: int, train: Train, reference: Arm, budget: float
) -> Search:
    """Train plans along ``path`` from ``start`` (see the module docstring); ``train``
    trains (or reuses) one plan's arm. ``start`` is at least 1."""
    passed_at, failed_at = 0, len(path)  # the bisection's ends: all-bf16 passes
    index = tried = start
    history: list[dict[str, Any]] = []
    arms: dict[int, Arm] = {}
    while len(history) < rounds:
        arm = train(path[index])
        arms[index], tried = arm, index
        passed = arm.passed(reference, budget)
        history.append(
            {"index": index, "layers": dict(path[index].layers),
             "estimate": path[index].estimate, "gap": arm.gap(reference),
             "passed": passed, "completed": arm.completed}
        )  # fmt: skip
        if not arm.completed:
            break  # max_time ran out: no verdict to move on
        if passed:
            passed_at = index
        else:
            failed_at = index
        index = (passed_at + failed_at) // 2
        if index == passed_at:
            break  # the ends met: every plan between them was tried
    chosen = passed_at if passed_at > 0 else tried
    return Search(path[chosen], arms[chosen], history)


def train_choice(
    choice: Choice,
    name: str,
    trained: list[Arm],
    factory: Callable[..., Any],
    seeds: list[int],
    steps: int,
    deadline: float | None,
    tick: Callable[[], None],
) -> Arm:
    """Train ``choice`` as arm ``name``, or reuse an arm that trained the same layers (the
    all-bf16 plan computes exactly what bf16-mixed does)."""
    for arm in trained:
        if arm.layers == choice.layers:
            for _ in seeds:
                tick()
            return Arm(name, dict(choice.layers), list(arm.final_losses), arm.completed)
    plan = PrecisionPlan("bf16-mixed", choice.layers)
    arm = verify_arm(name, factory, plan, seeds, steps, deadline, tick)
    trained.append(arm)
    return arm
