"""``amped compare`` from parsed arguments to exit code: check, run, report, print.

Every argument is checked before any training starts (recipes, device, factory spec,
the layers each FP8/block recipe converts, report folder), so a mistake costs a second,
not a run, and leaves an existing report folder as it was.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from amped.cli.compare.progress import LineProgress, RichProgress
from amped.cli.compare.report import write_report
from amped.cli.compare.table import print_summary
from amped.cli.errors import EXIT_DIVERGED, EXIT_OK, RunError
from amped.cli.out_dir import resolve_out
from amped.cli.width import wrap
from amped.comparison import interrupt
from amped.comparison.budget import Budget
from amped.comparison.compare import Comparison, baseline_first, run_comparison
from amped.comparison.result import CompareResult
from amped.comparison.results import dumps
from amped.comparison.run import CompareConfig
from amped.comparison.setup import make_config

__all__ = ["run_compare"]


def _config(args: argparse.Namespace) -> CompareConfig:
    """Check every argument, and build the task once (which also checks its contract)."""
    return make_config(
        recipes=args.recipes,
        model=args.model or None,
        steps=args.steps,
        batch_size=args.batch_size,
        device=args.device or None,
        seed=args.seed,
        max_time=args.max_time or None,
        threads=args.threads,
        isolate_memory=args.peak_memory == "own-process",
        module_filter=args.module_filter,
        exclude=args.exclude,
        attention=args.attention,
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
        results = CompareResult.of(comparison, command).to_dict()
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
