"""Fit a comparison into ``--max-time``: time a few steps of each recipe, then one step
count for all, so losses compare like with like::

    steps = clamp(floor((max_time - time spent timing) / sum of step estimates),
                  MIN_STEPS, requested steps)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from amped.cli.run import CompareConfig, Observer, RecipeRun, run_recipe

__all__ = ["MIN_STEPS", "TIMING_STEPS", "Plan", "make_plan"]

TIMING_STEPS = 3
MIN_STEPS = 3


@dataclass(frozen=True)
class Plan:
    """The step count a budget allows, and what it was derived from."""

    steps: int
    requested: int
    max_time: float
    timing_s: float
    step_s: dict[str, float]  # estimated seconds per step, by recipe

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
            "note": self.note(),
        }

    def note(self) -> str:
        if not self.shortened:
            return f"{self.steps} steps per recipe fit --max-time {self.max_time:g} s"
        slowest = max(self.step_s, key=self.step_s.__getitem__)
        return (
            f"{self.steps} of {self.requested} steps per recipe, to fit --max-time "
            f"{self.max_time:g} s; the slowest in the first timed steps, {slowest}, took "
            f"{self.step_s[slowest]:.2f} s a step"
        )


def _estimate(step_times: list[float]) -> float:
    timed = step_times[1:] or step_times
    return sum(timed) / len(timed)


def make_plan(
    config: CompareConfig,
    runs: list[RecipeRun],
    observer: Observer,
    timed: dict[str, list[float]] | None = None,
    timed_s: float = 0.0,
) -> Plan | None:
    """Time every recipe and set ``steps_planned`` on ``runs``; None without a budget.

    ``timed`` holds step times already measured (by the memory probes, which took
    ``timed_s`` seconds); only the recipes missing from it are timed here. A recipe
    that fails while being timed is marked failed in ``runs`` and not run again.
    """
    if not config.max_time or config.steps <= TIMING_STEPS:
        return None  # nothing to fit, or timing would cost as much as the run
    if any(not (timed or {}).get(run.recipe.name) for run in runs):
        observer.planning(runs)  # some recipes still need their timing steps
    began = time.monotonic() - timed_s
    estimates: dict[str, float] = {}
    for run in runs:
        known = (timed or {}).get(run.recipe.name)
        if known:
            estimates[run.recipe.name] = _estimate(known)
            continue
        probe = RecipeRun(run.recipe, TIMING_STEPS, TIMING_STEPS)
        run_recipe(config, probe, Observer(), evaluate=False)
        if probe.status == "failed":
            run.status, run.error = probe.status, probe.error
            run.error_traceback = probe.error_traceback
        elif probe.step_times:
            estimates[run.recipe.name] = _estimate(probe.step_times)
    timing = time.monotonic() - began
    per_round = sum(estimates.values())
    fit = int((config.max_time - timing) / per_round) if per_round > 0 else config.steps
    steps = max(MIN_STEPS, min(config.steps, fit))
    for run in runs:
        run.steps_planned = steps
    plan = Plan(steps, config.steps, config.max_time, timing, estimates)
    observer.planned(runs, plan.note())
    return plan
