"""Fit a comparison into ``--max-time``: estimate each recipe's step time, then one step
count for all, so losses compare like with like::

    steps = clamp(floor(seconds left of the budget / sum of step estimates), 1, --steps)

The estimates come from the memory probes' steps, else from :data:`TIMING_STEPS` steps
run here, each recipe within its share of half of what is left (:mod:`amped.comparison.budget`);
either way after the warm-up (:mod:`amped.comparison.warmup`), so no compile is in them: the
median of a run's steps after its first (which allocates the optimizer's state). A recipe
whose timing share ran out after one step is estimated by that step, and the plan says
so; training still spends each recipe's share of the budget on steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from amped._internal.stats import median
from amped.comparison.budget import Budget
from amped.comparison.run import CompareConfig, Observer, RecipeRun, run_recipe

__all__ = ["TIMING_STEPS", "Plan", "estimate_step", "make_plan"]

TIMING_STEPS = 5
_TIMING_SHARE = 0.5  # of what is left: the most the timing steps may take together


@dataclass(frozen=True)
class Plan:
    """The step count a budget allows, and what it was derived from."""

    steps: int
    requested: int
    max_time: float
    timing_s: float  # seconds spent before the plan: probes and timing steps
    step_s: dict[str, float]  # estimated seconds per step, by recipe
    one_step: tuple[str, ...] = ()  # recipes estimated from a single timed step

    @property
    def shortened(self) -> bool:
        return self.steps < self.requested

    def as_dict(self) -> dict[str, Any]:
        """The plan as recorded in ``results.json`` (``plan``)."""
        return {
            "steps": self.steps,
            "shortened": self.shortened,
            "max_time_s": self.max_time,
            "timing_s": round(self.timing_s, 3),
            "step_s": self.step_s,
            "one_step": list(self.one_step),
            "note": self.note(),
        }

    def note(self) -> str:
        unknown = ""
        if self.one_step:
            unknown = (
                f"; {', '.join(self.one_step)} timed one step only, too few to leave its "
                "first out: estimated from it"
            )
        if not self.shortened:
            return f"{self.steps} steps per recipe fit --max-time {self.max_time:g} s{unknown}"
        if not self.step_s:
            return f"{self.steps} of {self.requested} steps per recipe{unknown}"
        slowest = max(self.step_s, key=self.step_s.__getitem__)
        return (
            f"{self.steps} of {self.requested} steps per recipe, to fit --max-time "
            f"{self.max_time:g} s ({self.timing_s:.0f} s of it went to probes and timing); "
            f"the slowest, {slowest}, took about {self.step_s[slowest]:.2f} s a step{unknown}"
        )


def estimate_step(step_times: list[float]) -> float | None:
    """Seconds per step: the median of the steps after the first, which is left out (a
    model's first step allocates its optimizer state; a stall on a busy machine would
    move a mean); None with fewer than two."""
    timed = step_times[1:]
    return median(timed) if timed else None


def make_plan(
    config: CompareConfig,
    runs: list[RecipeRun],
    observer: Observer,
    budget: Budget,
) -> Plan | None:
    """Estimate every recipe's step time and set ``steps_planned`` on ``runs``; None
    without a budget.

    Every recipe is timed here, in this process: the memory probes' steps run under an
    allocator that maps and unmaps every large block (:mod:`amped.comparison.probe`),
    about 15 ms a step slower on the built-in task, so their times are not the run's.
    A recipe that fails while being timed is marked failed in ``runs`` and not run again.
    """
    if not budget.limited or config.steps <= TIMING_STEPS:
        return None  # nothing to fit, or timing would cost as much as the run
    estimates: dict[str, float] = {}
    untimed = [r for r in runs if r.status != "failed"]
    if untimed:
        observer.planning(runs)
    timing_deadline = time.monotonic() + _TIMING_SHARE * budget.left()
    one_step: list[str] = []
    for run in list(untimed):
        share = (timing_deadline - time.monotonic()) / max(len(untimed), 1)
        untimed = untimed[1:]
        probe = RecipeRun(run.recipe, TIMING_STEPS, TIMING_STEPS)
        run_recipe(config, probe, Observer(), evaluate=False,
                   deadline=time.monotonic() + max(share, 0.0))  # fmt: skip
        if probe.status == "failed":
            run.status, run.error = probe.status, probe.error
            run.error_traceback = probe.error_traceback
        elif (estimate := estimate_step(probe.step_times)) is not None:
            estimates[run.recipe.name] = estimate
        elif probe.step_times:  # after the warm-up: a first step, but not a compile's
            estimates[run.recipe.name] = probe.step_times[0]
            one_step.append(run.recipe.name)
    per_round = sum(estimates.values())
    fit = int(budget.left() / per_round) if per_round > 0 else config.steps
    steps = max(1, min(config.steps, fit))
    for run in runs:
        run.steps_planned = steps
    plan = Plan(steps, config.steps, float(budget.max_time or 0), budget.elapsed(), estimates,
                tuple(one_step))  # fmt: skip
    observer.planned(runs, plan.note())
    return plan
