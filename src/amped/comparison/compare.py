"""Run the comparison: the same task trained once per recipe, float32 first.

Every recipe starts from the same weights, sees the same batches and trains the same
number of steps; recipes run one after another, so one model is in memory at a time.
``--max-time`` bounds the whole of it, probes included (:mod:`amped.comparison.budget`), but
for the warm-up that comes first: each recipe's first steps and compiles
(:mod:`amped.comparison.warmup`), which no plan or step time includes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from amped.comparison import interrupt
from amped.comparison.budget import PROBE_SHARE, Budget
from amped.comparison.interrupt import graceful_interrupts
from amped.comparison.plan import Plan, make_plan
from amped.comparison.probe import PROBE_KIND, ProbeResult, probe_recipe
from amped.comparison.run import OUT_OF_TIME, CompareConfig, Observer, RecipeRun, run_recipe
from amped.comparison.timing import CpuLoad
from amped.comparison.warmup import Warmup, warm_up
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
    machine: dict[str, Any] | None = None  # the CPU load while it ran (amped.comparison.timing)
    budget: Budget | None = None  # --max-time, and what it cut
    warmups: list[Warmup] = field(default_factory=list)  # the warm-up phase, by recipe

    @property
    def task(self) -> dict[str, Any] | None:
        """The task as the first run that built it described it."""
        return next((r.task for r in self.runs if r.task is not None), None)


def baseline_first(recipes: tuple[Recipe, ...]) -> tuple[Recipe, ...]:
    """``recipes`` with fp32 moved to the front (the baseline the others are measured by)."""
    return tuple(sorted(recipes, key=lambda r: r.name != BASELINE))


def run_comparison(
    config: CompareConfig, observer: Observer | None = None, budget: Budget | None = None
) -> Comparison:
    """Plan, then run every recipe of ``config`` in turn.

    ``budget``: the clock of ``config.max_time``, when it started before this call
    (the command starts it before checking the task); a new one otherwise.

    A recipe that raises is recorded as failed and the others still run. Ctrl-C
    (KeyboardInterrupt) marks the running recipe interrupted and the comparison
    partial, and returns what was gathered. UsageError (the task breaks its
    contract) propagates.
    """
    observer = observer or Observer()
    runs = [RecipeRun(r, config.steps, config.steps) for r in baseline_first(config.recipes)]
    budget = budget or Budget(config.max_time)
    comparison = Comparison(config, runs, budget=budget)
    start = time.monotonic()
    load = CpuLoad(config.threads or torch.get_num_threads()).start()
    try:
        with graceful_interrupts():
            with budget.paused():
                comparison.warmups = _warm_up_all(config, runs, observer)
            probes = _probe_all(config, runs, observer, budget, comparison.warmups)
            comparison.plan = make_plan(config, runs, observer, budget)
            _train_all(config, runs, observer, budget, comparison.plan, probes)
    except KeyboardInterrupt:
        comparison.partial = True
    budget.stop()
    comparison.wall_s = time.monotonic() - start
    comparison.machine = load.stop()
    return comparison


def _warm_up_all(config: CompareConfig, runs: list[RecipeRun], observer: Observer) -> list[Warmup]:
    """Each recipe's warm-up steps, compiles included (:mod:`amped.comparison.warmup`)."""
    warmups = []
    for run in runs:
        warmups.append(warm_up(config, run, observer))
        interrupt.check()
    return warmups


def _probe_all(
    config: CompareConfig,
    runs: list[RecipeRun],
    observer: Observer,
    budget: Budget,
    warmups: list[Warmup],
) -> dict[str, ProbeResult]:
    """Each recipe's peak memory (and a few step times) from a process of its own, if
    all the probes fit :data:`~amped.comparison.budget.PROBE_SHARE` of the budget.

    When they do not (judged from the probes run so far), no recipe keeps an
    own-process peak: every one is measured in process, so that the peak column
    compares like with like. The probes' step times are kept for the plan. A probe's
    process compiles (or loads from Inductor's cache) what the warm-up compiled here:
    that time is left out of the budget, and added to the probe's time limit.
    """
    if not config.isolate_memory or config.device.type != "cpu":
        return {}
    threads = config.threads or torch.get_num_threads()
    probes: dict[str, ProbeResult] = {}
    spent = 0.0  # seconds the probes took so far
    compile_s = {w.recipe: w.seconds for w in warmups if w.compiles}
    for index, run in enumerate(runs):
        if run.status == "failed":  # in its warm-up
            continue
        left = budget.probe_left()
        each = spent / index if index else 0.0  # each probe's time, from those run
        if left <= 0 or each * (len(runs) - index) > left:
            budget.note_cut(
                f"peak memory measured in this process for every recipe: the {len(runs)} "
                f"own-process probes (about {each:.1f} s each) did not fit "
                f"{PROBE_SHARE:.0%} of --max-time"
            )
            return {name: replace(p, peak_bytes=None) for name, p in probes.items()}
        observer.probing(run)
        began = time.monotonic()
        timeout = left + compile_s.get(run.recipe.name, 0.0)
        probe = probe_recipe(config, run, threads, timeout=timeout)
        probes[run.recipe.name] = probe
        budget.exclude(probe.compile_s)
        spent += time.monotonic() - began - probe.compile_s
        interrupt.check()
    return probes


def _train_all(
    config: CompareConfig,
    runs: list[RecipeRun],
    observer: Observer,
    budget: Budget,
    plan: Plan | None,
    probes: dict[str, ProbeResult],
) -> None:
    """Train each recipe not yet run, within its share of what is left of the budget."""
    estimates = dict(plan.step_s) if plan else {}
    pending = [run for run in runs if run.status == "not_run"]
    known = [estimates[r.recipe.name] for r in pending if r.recipe.name in estimates]
    fallback = sum(known) / len(known) if known else 1.0  # equal shares without estimates
    for index, run in enumerate(pending):
        weights = [estimates.get(r.recipe.name, fallback) for r in pending[index:]]
        deadline = budget.share(weights[0], sum(weights))
        run_recipe(config, run, observer, deadline=deadline)
        _own_process_peak(run, probes.get(run.recipe.name))
        if run.stop_reason == OUT_OF_TIME:
            budget.note_cut(
                f"{run.recipe.name} stopped after {len(run.losses)} of {run.steps_planned} "
                "steps: its share of --max-time was spent"
            )
        interrupt.check()


def _own_process_peak(run: RecipeRun, probe: ProbeResult | None) -> None:
    """Replace the in-process peak by the own-process one where the probe measured it."""
    if probe is not None and probe.peak_bytes is not None:
        run.peak_memory_bytes, run.peak_memory_kind = probe.peak_bytes, PROBE_KIND
