"""``amped compare`` from parsed arguments to exit code: check, run, report, print.

Every argument is checked before any training starts (recipes, device, factory spec,
report folder), so a mistake costs a second, not a run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from amped._internal.files import check_writable
from amped.cli import interrupt
from amped.cli.compare import Comparison, baseline_first, run_comparison
from amped.cli.compare_report import write_report
from amped.cli.dtypes import recipe_for_dtype
from amped.cli.environment import default_device, describe, resolve_device
from amped.cli.errors import EXIT_DIVERGED, EXIT_OK, RunError, UsageError
from amped.cli.factory import DEFAULT_FACTORY, load_factory
from amped.cli.progress import LineProgress, RichProgress
from amped.cli.results import dumps, to_dict
from amped.cli.run import CompareConfig
from amped.cli.table import print_summary
from amped.recipes import Recipe
from amped.recipes.registry import RECIPES, resolve_recipe

__all__ = ["parse_recipes", "resolve_out", "run_compare"]


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
            raise UsageError(f"{error}. Received: --recipes {text!r}") from None
        if recipe not in chosen:
            chosen.append(recipe)
    return tuple(chosen)


def resolve_out(path: str) -> Path:
    """The report folder, created and test-written now, so that a bad or unwritable
    ``--out`` fails before any training (UsageError)."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise UsageError(
            f"--out must be a folder, but {path!r} is a file. Received: --out {path!r}"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(
            f"Cannot create the report folder ({error.strerror}). Received: --out {path!r}"
        ) from None
    try:
        check_writable(out)
    except OSError as error:
        raise UsageError(
            f"Cannot write into the report folder ({error.strerror or error}); choose a "
            f"writable --out. Received: --out {path!r}"
        ) from None
    return out


def _config(args: argparse.Namespace) -> CompareConfig:
    """Check every argument, and build the task once (which also checks its contract)."""
    recipes = parse_recipes(args.recipes)
    device = resolve_device(args.device or default_device())
    factory = load_factory(args.model or DEFAULT_FACTORY)
    task = factory.check(batch_size=args.batch_size, seed=args.seed, device=device)
    threads, source = torch.get_num_threads(), "torch's default"
    if args.threads is not None:
        threads, source = args.threads, "--threads"
    elif task.threads is not None and device.type == "cpu":
        threads, source = task.threads, "the task's choice"
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
    config = _config(args)
    out = resolve_out(args.out)
    observer = _observer(args, config)
    # SIGINT/SIGTERM from here on: training stops at the next step, and the report
    # (partial or not) is still rendered and written; a second signal raises at once.
    with interrupt.graceful_interrupts():
        with observer:
            comparison = run_comparison(config, observer)
        results = to_dict(comparison, describe(config.device), command)
        try:
            paths = write_report(results, out)
        except OSError as error:
            raise RunError(f"Could not write the report into {str(out)!r}: {error}") from None
        signalled = interrupt.requested()
    if args.json:
        sys.stdout.write(dumps(results))
        sys.stdout.flush()
    else:
        print_summary(results, paths)
    return _exit_code(comparison, results, args.traceback, signalled)


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
            f"amped: {len(diverged)} recipe(s) diverged, their losses non-finite: {listed}",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_DIVERGED
    return EXIT_OK
