"""Run the comparison: the same task trained once per recipe, float32 first.

Every recipe starts from the same weights and sees the same batches (the factory is
called afresh after ``torch.manual_seed(seed)``), and all train the same number of
steps (:mod:`amped.cli.plan` fits it to the time budget), so the loss at any step and
the held-out metrics are comparable across recipes. Recipes run one after another, so
only one model is in memory at a time; on a busy machine, absolute timings drift.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from amped.cli import interrupt
from amped.cli.interrupt import graceful_interrupts
from amped.cli.plan import Plan, make_plan
from amped.cli.run import CompareConfig, Observer, RecipeRun, run_recipe
from amped.recipes import Recipe

__all__ = ["BASELINE", "Comparison", "baseline_first", "run_comparison"]

BASELINE = "fp32"


@dataclass
class Comparison:
    """A whole comparison: its runs in order, the plan, and whether it finished."""

    config: CompareConfig
    runs: list[RecipeRun]
    plan: Plan | None = None
    partial: bool = False
    wall_s: float = 0.0

    @property
    def task(self) -> dict[str, Any] | None:
        """The task as the first run that built it described it."""
        return next((r.task for r in self.runs if r.task is not None), None)


def baseline_first(recipes: tuple[Recipe, ...]) -> tuple[Recipe, ...]:
    """``recipes`` with fp32 moved to the front (the baseline the others are measured by)."""
    return tuple(sorted(recipes, key=lambda r: r.name != BASELINE))


def run_comparison(config: CompareConfig, observer: Observer | None = None) -> Comparison:
    """Plan, then run every recipe of ``config`` in turn.

    A recipe that raises is recorded as failed and the others still run. Ctrl-C
    (KeyboardInterrupt) marks the running recipe interrupted and the comparison
    partial, and returns what was gathered. UsageError (the task breaks its
    contract) propagates.
    """
    observer = observer or Observer()
    runs = [RecipeRun(r, config.steps, config.steps) for r in baseline_first(config.recipes)]
    comparison = Comparison(config, runs)
    start = time.monotonic()
    try:
        with graceful_interrupts():
            comparison.plan = make_plan(config, runs, observer)
            for run in runs:
                if run.status == "not_run":
                    run_recipe(config, run, observer)
                interrupt.check()
    except KeyboardInterrupt:
        comparison.partial = True
    comparison.wall_s = time.monotonic() - start
    return comparison
