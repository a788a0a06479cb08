"""Run the comparison: the same task trained once per recipe, float32 first.

Every recipe starts from the same weights, sees the same batches and trains the same
number of steps; recipes run one after another, so one model is in memory at a time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from amped.cli import interrupt
from amped.cli.interrupt import graceful_interrupts
from amped.cli.plan import Plan, make_plan
from amped.cli.probe import PROBE_KIND, ProbeResult, probe_recipe
from amped.cli.run import CompareConfig, Observer, RecipeRun, run_recipe
from amped.cli.timing import CpuLoad
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
    machine: dict[str, Any] | None = None  # the CPU load while it ran (amped.cli.timing)

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
    load = CpuLoad(config.threads or torch.get_num_threads()).start()
    try:
        with graceful_interrupts():
            probes = _probe_all(config, runs, observer)
            timed = {name: p.step_times for name, p in probes.items() if p.step_times}
            comparison.plan = make_plan(
                config, runs, observer, timed, time.monotonic() - start if probes else 0.0
            )
            for run in runs:
                if run.status == "not_run":
                    run_recipe(config, run, observer)
                    _own_process_peak(run, probes.get(run.recipe.name))
                interrupt.check()
    except KeyboardInterrupt:
        comparison.partial = True
    comparison.wall_s = time.monotonic() - start
    comparison.machine = load.stop()
    return comparison


def _probe_all(
    config: CompareConfig, runs: list[RecipeRun], observer: Observer
) -> dict[str, ProbeResult]:
    """Each recipe's peak memory (and a few step times) from a process of its own."""
    if not config.isolate_memory or config.device.type != "cpu":
        return {}
    threads = config.threads or torch.get_num_threads()
    probes = {}
    for run in runs:
        observer.probing(run)
        probes[run.recipe.name] = probe_recipe(config, run, threads)
        interrupt.check()
    return probes


def _own_process_peak(run: RecipeRun, probe: ProbeResult | None) -> None:
    """Replace the in-process peak by the own-process one where the probe measured it."""
    if probe is not None and probe.peak_bytes is not None:
        run.peak_memory_bytes, run.peak_memory_kind = probe.peak_bytes, PROBE_KIND
