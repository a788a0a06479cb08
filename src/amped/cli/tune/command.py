"""``amped tune`` from parsed arguments to exit code: check, tune, report, print.

Every argument is checked before anything is measured (formats, device, the factory
and its task, that the model has a layer to tune, and attention with ``--attention``,
the report folder), so a mistake
costs a second. Then :func:`amped.tune` measures, chooses and verifies; its document is
written as ``tuned.json`` with ``tune.html`` beside it, and the exit code says whether
a plan passed (docs/robustness.md, "Exit codes").
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

import amped
from amped.cli.errors import EXIT_NO_PLAN, EXIT_OK, RunError, UsageError
from amped.cli.out_dir import resolve_out
from amped.cli.tune.progress import TuneLines, TuneProgress
from amped.cli.tune.report import write_report
from amped.cli.tune.table import print_tune
from amped.cli.width import wrap
from amped.comparison import interrupt
from amped.comparison.environment import default_device, resolve_device
from amped.comparison.layers import LayerChoice
from amped.comparison.results import dumps
from amped.comparison.setup import choose_threads
from amped.comparison.warmup import WARMUP_STEPS
from amped.recipes.attention import convert_model_attention
from amped.recipes.plan import PrecisionPlan
from amped.tasks.factory import DEFAULT_FACTORY, TaskFactory, load_factory
from amped.tasks.task import Task
from amped.tuning.measure import eligible_layers
from amped.tuning.summary import outcome
from amped.tuning.tuner import DEFAULT_FORMATS, REFERENCE_DIVERGED
from amped.tuning.verify import train_losses

__all__ = ["exit_code", "parse_formats", "run_tune"]


def parse_formats(text: str) -> list[str]:
    """``--formats``: comma-separated format names, or ``all`` (every FP8 and block
    format; with other names too, since it holds them); duplicates dropped, case
    ignored."""
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    allowed = ", ".join(DEFAULT_FORMATS)
    if not names:
        raise UsageError(f"--formats names no format; choose among {allowed} or all. "
                         f"Received: --formats {text!r}")  # fmt: skip
    unknown = [n for n in names if n not in DEFAULT_FORMATS and n != "all"]
    if unknown:
        hint = " (bf16 is always a choice: leave it out)" if "bf16" in unknown else ""
        raise UsageError(
            f"Unknown format {unknown[0]!r}{hint}; the formats are {allowed} or all. "
            f"Received: --formats {text!r}"
        )
    if "all" in names:  # all, repeated or with names it holds already: every format
        return list(DEFAULT_FORMATS)
    return list(dict.fromkeys(names))


def _check_layers(task: Task, formats: list[str], spec: str, layers: LayerChoice) -> None:
    """UsageError when the model has no layer that can run any of ``formats`` among
    those ``--module-filter`` and ``--exclude`` leave."""
    eligible, refused = eligible_layers(task.model, formats, set())
    chosen, modules = layers.by_name(), dict(task.model.named_modules())
    if chosen is not None:
        for name in [n for n in eligible if not chosen(modules[n], n)]:
            del eligible[name]
            refused[name] = f"not chosen by {layers.describe()}"
    if eligible:
        return
    seen = "; ".join(f"{name or '<model>'}: {why}" for name, why in refused.items())
    raise UsageError(
        f"The model from {spec} has no layer amped tune can lower to {', '.join(formats)}: "
        "it tunes nn.Linear and transformers Conv1D layers whose dims are multiples of the "
        "format's block (16 for FP8, 32 for the MX formats). Give a model with such "
        "layers, or choose them with --module-filter. Received: "
        f"{seen or 'no nn.Linear or Conv1D layer'}"
    )


def _check_attention(task: Task, attention: str | None, spec: str) -> None:
    """UsageError when ``--attention`` is given for a model with no attention that
    ``prepare(..., attention=...)`` converts (checked on a copy)."""
    if attention is None:
        return
    conversion = convert_model_attention(copy.deepcopy(task.model), "bf16")
    whole = [why for name, why in conversion.not_converted if name == ""]
    if whole:
        raise UsageError(
            f"--attention tunes the attention amped converts (nn.MultiheadAttention, a "
            f"transformers model's), and the model from {spec} has none: {whole[0]}. Leave "
            f"--attention out. Received: --attention {attention}"
        )


def _warm_up(build: Any, task: Task, formats: list[str], layers: LayerChoice, seed: int) -> None:
    """Two training steps per format, every layer that can run it lowered, before
    ``--max-time``'s clock (which :func:`amped.tune` starts): the FP8 and block casts
    of large operands compile here (or load from Inductor's cache), not in the first
    verification run that lowers them. A format that fails here fails again, and is
    reported, in the measurement."""
    eligible, _ = eligible_layers(task.model, formats, set())
    chosen, modules = layers.by_name(), dict(task.model.named_modules())
    for fmt in formats:
        names = [n for n, fits in eligible.items() if fmt in fits]
        names = [n for n in names if chosen is None or chosen(modules[n], n)]
        if not names:
            continue
        began = time.monotonic()
        with contextlib.suppress(Exception):  # the measurement reports any error
            train_losses(build, PrecisionPlan("bf16-mixed", dict.fromkeys(names, fmt)), seed,
                         WARMUP_STEPS)  # fmt: skip
        text = (f"amped tune: warm-up of {fmt} ({WARMUP_STEPS} steps, its compiles "
                f"included; outside --max-time): {time.monotonic() - began:.1f} s")  # fmt: skip
        print(wrap(text), file=sys.stderr, flush=True)


def _task_builder(factory: TaskFactory, batch_size: int | None, device: torch.device) -> Any:
    """``amped.tune``'s factory: the CLI's task for a seed, its model on ``device``."""

    def build(seed: int) -> Task:
        task = factory.build(batch_size=batch_size, seed=seed, device=device)
        task.model = task.model.to(device)
        return task

    return build


def run_tune(args: argparse.Namespace, command: list[str]) -> int:
    """Run ``amped tune``; returns the exit code (raises UsageError / RunError)."""
    threads = torch.get_num_threads()
    try:
        return _tune(args, command)
    finally:
        torch.set_num_threads(threads)  # main() may be called in process, e.g. by tests


def _tune(args: argparse.Namespace, command: list[str]) -> int:
    formats = parse_formats(args.formats)
    device = resolve_device(args.device or default_device())
    factory = load_factory(args.model or DEFAULT_FACTORY)
    task = factory.check(batch_size=args.batch_size, seed=args.seed, device=device)
    layers = LayerChoice(args.module_filter, args.exclude)
    _check_layers(task, formats, factory.spec, layers)
    _check_attention(task, args.attention, factory.spec)
    torch.set_num_threads(choose_threads(args.threads, task.threads, device)[0])
    out = resolve_out(args.out)  # created only once the task is known to tune
    _warm_up(_task_builder(factory, args.batch_size, device), task, formats, layers, args.seed)
    stderr = Console(stderr=True)
    progress = TuneLines() if args.no_progress or not stderr.is_terminal else TuneProgress(stderr)
    # SIGINT/SIGTERM from here on: the first stops the run at the next progress report
    # (between two measurements or verification runs), and nothing is written, since a
    # plan is only written with its verification; one that arrives after the last
    # report lets the report be written, then exits 130/143, as amped compare does.
    # A second signal stops at once.
    with interrupt.graceful_interrupts():
        with progress:
            tuned = _run(args, factory, device, formats, progress).to_dict()
        context = {
            "task": task.name or factory.label,
            "device": str(device),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": command,
        }
        try:
            paths = write_report(tuned, context, out)
        except OSError as error:
            raise RunError(f"Could not write the report into {str(out)!r}: {error}") from None
        signalled = interrupt.show_written(lambda: _show(args, tuned, paths))
    if signalled:
        print("amped: interrupted: the report is written", file=sys.stderr, flush=True)
        return interrupt.exit_code()
    return exit_code(tuned)


def _show(args: argparse.Namespace, tuned: dict[str, Any], paths: tuple[Path, ...]) -> None:
    if args.json:
        sys.stdout.write(dumps(tuned))
        sys.stdout.flush()
    else:
        print_tune(tuned, paths)


def _run(
    args: argparse.Namespace,
    factory: TaskFactory,
    device: torch.device,
    formats: list[str],
    progress: TuneProgress | TuneLines,
) -> Any:
    try:
        return amped.tune(
            _task_builder(factory, args.batch_size, device),
            formats=formats,
            budget=args.budget,
            steps=args.steps,
            seeds=args.seeds,
            seed=args.seed,
            rounds=args.rounds,
            max_time=args.max_time or None,
            progress=progress,
            module_filter=LayerChoice(args.module_filter, args.exclude).by_name(),
            attention=args.attention,
        )
    except KeyboardInterrupt:
        raise
    except Exception as error:  # main() prints its traceback under --traceback
        text = str(error).strip().splitlines()[0] if str(error).strip() else ""
        hint = "" if args.traceback else " (rerun with --traceback for details)"
        raise RunError(f"amped tune failed: {type(error).__name__}: {text}{hint}") from error


def exit_code(tuned: dict[str, Any]) -> int:
    """The exit status for a tuned.json document: 0 when the plan passed, else
    :data:`~amped.cli.errors.EXIT_NO_PLAN` (3), said in a line on stderr."""
    state = outcome(tuned)
    if state == "passed":
        return EXIT_OK
    no_plan = "no plan met the budget"
    if str(tuned["reason"]).startswith(REFERENCE_DIVERGED):  # no budget can help then
        no_plan = f"{REFERENCE_DIVERGED}, so no plan can be judged"
    what = {
        "no_plan": f"{no_plan}; tuned.json holds the all-bf16 plan and the reason",
        "failed": "the plan failed its verification (tuned.json marks it failed)",
        "incomplete": "--max-time ran out before the verification finished, so the plan "
        "does not pass",
    }[state]
    print(wrap(f"amped tune: {what}: exit status {EXIT_NO_PLAN}"), file=sys.stderr, flush=True)
    return EXIT_NO_PLAN
