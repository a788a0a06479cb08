"""``amped compare`` from parsed arguments to exit code: check, run, report, print.

Every argument is checked before any training starts (recipes, device, factory spec,
the layers each FP8/block recipe converts, report folder), so a mistake costs a second,
not a run, and leaves an existing report folder as it was.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from amped.cli import interrupt
from amped.cli.budget import Budget
from amped.cli.compare import Comparison, baseline_first, run_comparison
from amped.cli.compare_report import write_report
from amped.cli.dtypes import recipe_for_dtype
from amped.cli.environment import default_device, describe, resolve_device
from amped.cli.errors import EXIT_DIVERGED, EXIT_OK, RunError, UsageError
from amped.cli.factory import DEFAULT_FACTORY, load_factory
from amped.cli.layers import LayerChoice, dry_run
from amped.cli.out_dir import resolve_out
from amped.cli.progress import LineProgress, RichProgress
from amped.cli.results import dumps, to_dict
from amped.cli.run import CompareConfig
from amped.cli.table import print_summary
from amped.cli.timing import CpuLoad
from amped.cli.width import wrap
from amped.recipes import Recipe
from amped.recipes.registry import RECIPES, resolve_recipe

__all__ = ["choose_threads", "parse_recipes", "resolve_out", "run_compare"]

_LOAD_SAMPLE_S = 0.5  # how long the CPU load is sampled before choosing threads


def parse_recipes(text: str) -> tuple[Recipe, ...]:
    """``--recipes``: comma-separated names or aliases, or ``all``; duplicates dropped.

    A dtype name as torch spells it (``bfloat16``, ``float16``, ``float32``) or its short
    alias stands for that dtype's mixed recipe (``fp32`` for float32).
    """
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise UsageError(f"--recipes names no recipe. Received: --recipes {text!r}")
    if [n.lower() for n in names] == ["all"]:
        return tuple(RECIPES.values())
    chosen: list[Recipe] = []
    for name in names:
        try:
            recipe = resolve_recipe(recipe_for_dtype(name) or name)
        except ValueError as error:
            what = str(error).split(" Received: ")[0]  # the flag, not the argument, received
            raise UsageError(f"{what} Received: --recipes {text!r}") from None
        if recipe not in chosen:
            chosen.append(recipe)
    return tuple(chosen)


def _config(args: argparse.Namespace) -> CompareConfig:
    """Check every argument, and build the task once (which also checks its contract)."""
    recipes = parse_recipes(args.recipes)
    device = resolve_device(args.device or default_device())
    factory = load_factory(args.model or DEFAULT_FACTORY)
    layers = LayerChoice(args.module_filter, args.exclude)
    task = factory.check(batch_size=args.batch_size, seed=args.seed, device=device)
    conversions = dry_run(task.model, recipes, layers)  # every recipe checked on the model
    threads, source = choose_threads(args.threads, task.threads, device)
    torch.set_num_threads(threads)  # once, before any recipe: the same for every one
    return CompareConfig(
        factory=factory,
        recipes=recipes,
        steps=args.steps,
        batch_size=args.batch_size,
        device=device,
        seed=args.seed,
        max_time=args.max_time or None,
        isolate_memory=args.peak_memory == "own-process",
        threads=threads,
        threads_source=source,
        layers=layers,
        conversions=tuple(conversions),
    )


def choose_threads(
    given: int | None, task_threads: int | None, device: torch.device
) -> tuple[int, str]:
    """The CPU threads for torch, and who chose them: ``--threads``, else the task's
    choice (on a CPU), else torch's default, or 1 on a busy CPU (:func:`_threads_for_load`)."""
    threads = torch.get_num_threads()
    if given is not None:
        return given, "--threads"
    if task_threads is not None and device.type == "cpu":
        return task_threads, "the task's choice"
    if device.type == "cpu" and threads > 1:
        return _threads_for_load(threads)
    return threads, "torch's default"


def _threads_for_load(threads: int) -> tuple[int, str]:
    """torch's default thread count, or 1 when other processes keep the cores busy:
    with more threads than free cores, each op's barrier waits for a preempted thread
    (docs/compare.md, ``--threads``)."""
    load = CpuLoad(threads).start()
    time.sleep(_LOAD_SAMPLE_S)
    machine = load.stop()
    if not machine["busy"]:
        return threads, "torch's default"
    others = machine["other_processes_cores"]
    used = f"{others:.1f} of {machine['cores']} cores" if others is not None else "the cores"
    return 1, (
        f"amped: other processes used {used} at the start, so 1 thread instead of "
        f"torch's {threads}; --threads N chooses"
    )


def _observer(args: argparse.Namespace, config: CompareConfig) -> RichProgress | LineProgress:
    stderr = Console(stderr=True)
    if args.no_progress or not stderr.is_terminal:
        return LineProgress()
    names = [r.name for r in baseline_first(config.recipes)]
    return RichProgress(names, config.steps, stderr)


def run_compare(args: argparse.Namespace, command: list[str]) -> int:
    """Run ``amped compare``; returns the exit code (raises UsageError / RunError)."""
    threads = torch.get_num_threads()
    try:
        return _compare(args, command)
    finally:
        torch.set_num_threads(threads)  # main() may be called in process, e.g. by tests


def _compare(args: argparse.Namespace, command: list[str]) -> int:
    budget = Budget(args.max_time or None)  # --max-time counts from here: the check included
    config = _config(args)
    out = resolve_out(args.out)  # created only once the task is known to build
    observer = _observer(args, config)
    # SIGINT/SIGTERM from here on: training stops at the next step, and the report
    # (partial or not) is still rendered and written; a second signal raises at once.
    with interrupt.graceful_interrupts():
        with observer:
            comparison = run_comparison(config, observer, budget)
        results = to_dict(comparison, describe(config.device), command)
        try:
            paths = write_report(results, out)
        except OSError as error:
            raise RunError(f"Could not write the report into {str(out)!r}: {error}") from None
        signalled = interrupt.show_written(lambda: _show(args, results, paths))
        return _exit_code(comparison, results, args.traceback, signalled)


def _show(args: argparse.Namespace, results: dict[str, Any], paths: tuple[Path, ...]) -> None:
    if args.json:
        sys.stdout.write(dumps(results))
        sys.stdout.flush()
    else:
        print_summary(results, paths)


def _exit_code(
    comparison: Comparison, results: dict[str, Any], show_tracebacks: bool, signalled: bool
) -> int:
    failed = [r for r in comparison.runs if r.status == "failed"]
    for run in failed:
        if show_tracebacks and run.error_traceback:
            print(run.error_traceback, file=sys.stderr)
    if comparison.partial or signalled:
        what = "partial results" if comparison.partial else "results"
        print(f"amped: interrupted: {what} written", file=sys.stderr, flush=True)
        return interrupt.exit_code()
    if failed:
        listed = "; ".join(f"{r.recipe.name} ({r.error})" for r in failed)
        hint = "" if show_tracebacks else " (rerun with --traceback for details)"
        raise RunError(f"{len(failed)} recipe(s) failed: {listed}{hint}")
    diverged = [r for r in results["recipes"] if r["diverged"]]
    if diverged:
        listed = "; ".join(f"{r['name']} (from step {r['diverged_at_step']})" for r in diverged)
        print(
            wrap(f"amped: {len(diverged)} recipe(s) diverged, their losses non-finite: {listed}"),
            file=sys.stderr,
            flush=True,
        )
        return EXIT_DIVERGED
    return EXIT_OK
