"""The verification rounds: the estimate orders the plans, training decides how far along
that order to go (docs/tune.md, "How it verifies").

The plans are :func:`amped.tuning.choose.plan_path`'s, from all-bfloat16 (index 0, which
passes by definition: it is the reference arm) to every layer in its fastest format. The
first round trains the last plan within the budget by the estimate. Then a bisection: a
plan that passes becomes the lower end (nothing smaller need be tried), one that fails the
upper end (nothing larger), and the next round trains the plan halfway between them, until
they meet or ``rounds`` plans were trained. The result is the largest plan that passed;
when none did, the last (smallest) one tried, reported as failed.

Then the first/last-N rules (:func:`amped.tuning.choose.rule_plans`) are candidates too
(:func:`search_rules`): in the estimate's order, a rule is trained only when it could beat
the best plan verified so far (as many or more GEMM FLOPs, speed-weighted), lowers other
layers than every plan trained, and does not contain a plan that failed (the bisection's
assumption: lowering more does not pass where less failed); at most ``rounds`` rules. The
tuner keeps the verified plan that passed with the most saving, ties to the smaller gap,
whichever source it came from.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from amped.recipes.plan import PrecisionPlan
from amped.tuning.choose import Choice
from amped.tuning.verify import Arm, verify_arm

__all__ = [
    "Candidate",
    "Search",
    "round_entry",
    "search_path",
    "search_rules",
    "source_of",
    "train_choice",
]

Train = Callable[[Choice], Arm]


@dataclass(frozen=True)
class Search:
    """The outcome of the rounds: the chosen plan, its arm, and every round in turn
    (:func:`round_entry`'s, with ``index`` the plan's place on the path)."""

    choice: Choice
    arm: Arm
    rounds: list[dict[str, Any]]


@dataclass(frozen=True)
class Candidate:
    """A trained plan: where it came from (:func:`source_of`), its choice and its arm."""

    source: str
    choice: Choice
    arm: Arm

    def beats(self, other: Candidate | None, reference: Arm) -> bool:
        """More saving than ``other`` (None: nothing), or as much at a smaller gap."""
        if other is None:
            return True
        if _same_saving(self.choice, other.choice):
            return self.arm.gap(reference) < other.arm.gap(reference)
        return self.choice.saving > other.choice.saving


def _same_saving(a: Choice, b: Choice) -> bool:
    # Equal FLOPs summed in another order may differ in the last bits.
    return math.isclose(a.saving, b.saving, rel_tol=1e-9, abs_tol=0.0)


def source_of(choice: Choice) -> str:
    """``"rule: first N/last M, <format>"`` for a rule, ``"estimate"`` for a path plan."""
    if choice.format is None or choice.first is None:
        return "estimate"
    return f"rule: first {choice.first}/last {choice.last}, {choice.format}"


def round_entry(candidate: Candidate, reference: Arm, budget: float) -> dict[str, Any]:
    """One ``rounds`` entry of a trained plan: ``source``, ``index`` (None here),
    ``layers``, ``attention`` (its spelling; only for a plan with one), ``estimate``, ``gap``,
    ``final_losses``, ``passed``, ``completed``."""
    choice, arm = candidate.choice, candidate.arm
    attention = {} if choice.attention is None else {"attention": str(choice.attention)}
    return {
        "source": candidate.source,
        "index": None,
        "layers": dict(choice.layers),
        **attention,
        "estimate": choice.estimate,
        "gap": arm.gap(reference),
        "final_losses": list(arm.final_losses),
        "passed": arm.passed(reference, budget),
        "completed": arm.completed,
    }


def _contains(layers: dict[str, str], failed: dict[str, str]) -> bool:
    return all(layers.get(n) == f for n, f in failed.items() if f != "bf16")


def search_rules(
    rules: list[Choice],
    best: Candidate | None,
    trained: list[dict[str, str]],
    failed: list[dict[str, str]],
    tries: int,
    train: Train,
    reference: Arm,
    budget: float,
) -> tuple[Candidate | None, list[Candidate]]:
    """Train rule candidates (the module docstring) in ``rules``' order, at most
    ``tries``, starting from ``best`` (the best passing plan so far, or None), the
    layers of every plan ``trained`` and those that ``failed``. Returns the best passing
    plan after them and every rule trained, in order; stops at a run cut short."""
    trained, failed = list(trained), list(failed)
    done: list[Candidate] = []
    while len(done) < tries:
        rule = next(
            (r for r in rules
             if r.layers not in trained
             and (best is None or r.saving > best.choice.saving
                  or _same_saving(r, best.choice))
             and not any(_contains(r.layers, f) for f in failed)),
            None,
        )  # fmt: skip
        if rule is None:
            break  # no rule left that could beat the best
        candidate = Candidate(source_of(rule), rule, train(rule))
        done.append(candidate)
        trained.append(rule.layers)
        if not candidate.arm.completed:
            break  # max_time ran out
        if not candidate.arm.passed(reference, budget):
            failed.append(rule.layers)
        elif candidate.beats(best, reference):
            best = candidate
    return best, done


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
        entry = round_entry(Candidate("estimate", path[index], arm), reference, budget)
        history.append(entry | {"index": index})
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
    """Train ``choice`` as arm ``name``, or reuse an arm that trained the same layers and
    attention (the all-bf16 plan computes exactly what bf16-mixed does)."""
    for arm in trained:
        if arm.layers == choice.layers and arm.attention == choice.attention:
            for _ in seeds:
                tick()
            return Arm(name, dict(choice.layers), list(arm.final_losses), arm.completed,
                       choice.attention)  # fmt: skip
    plan = PrecisionPlan("bf16-mixed", choice.layers, choice.attention)
    arm = verify_arm(name, factory, plan, seeds, steps, deadline, tick)
    trained.append(arm)
    return arm
