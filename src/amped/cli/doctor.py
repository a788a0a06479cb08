"""``amped doctor``: run the numerics doctor on the built-in task or a user's factory.

The task comes from the same factory contract as ``amped compare`` (``--model
module:factory``); the doctor checks one training step on its first batch. It prints
a table (the ops with the widest range, inf/NaN or underflow, the culprits and the
verified fix) and writes ``doctor.json`` and ``doctor.html`` into ``--out``, as one
set, atomically (:func:`amped.cli.files.write_files`); a write error is exit code 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from amped.cli.command import resolve_out
from amped.cli.environment import default_device, resolve_device
from amped.cli.errors import EXIT_OK, RunError, UsageError
from amped.cli.factory import DEFAULT_FACTORY, load_factory
from amped.cli.files import write_files
from amped.cli.task import to_device
from amped.doctor import Report, diagnose

__all__ = ["run_doctor"]

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def run_doctor(args: argparse.Namespace) -> int:
    """Run ``amped doctor``; returns the exit code (raises UsageError / RunError)."""
    if args.loss_scale is not None and not args.loss_scale > 0:
        raise UsageError(f"--loss-scale must be > 0. Received: --loss-scale {args.loss_scale}")
    device = resolve_device(args.device or default_device())
    factory = load_factory(args.model or DEFAULT_FACTORY)
    task = factory.check(batch_size=args.batch_size, seed=args.seed, device=device)
    out = resolve_out(args.out)
    model = task.model.to(device)
    inputs, targets = to_device(next(iter(task.batches)), device)
    try:
        report = diagnose(
            model,
            inputs,
            lambda output: task.loss_fn(output, targets),
            device_type=device.type,
            dtype=_DTYPES[args.dtype],
            policy=args.policy,
            loss_scale=args.loss_scale,
            seed=args.seed,
        )
    except (ValueError, TypeError) as error:
        raise UsageError(str(error)) from error
    except Exception as error:
        raise RunError(f"The doctor failed: {type(error).__name__}: {error}") from error
    html = out / "doctor.html"
    try:
        document, page = report.to_json(), report.to_html()
    except Exception as error:
        raise RunError(
            f"Could not render the doctor's report: {type(error).__name__}: {error}"
        ) from error
    try:
        write_files([(out / "doctor.json", document), (html, page)])
    except OSError as error:
        raise RunError(f"Could not write the doctor's report into {str(out)!r}: {error}") from None
    if args.json:
        sys.stdout.write(document + "\n")
    else:
        _print(report, html)
    return EXIT_OK


def _print(report: Report, html: Path) -> None:
    console = Console()
    table = Table(
        title=f"amped doctor: {report.dtype} on {report.device_type}, policy {report.policy.name!r}"
    )
    for column in ("module", "op", "dtype", "max |x|", "inf", "NaN", "underflow", "SQNR dB"):
        if column in ("module", "op"):
            table.add_column(column, overflow="fold")
        else:
            table.add_column(column, justify="right", no_wrap=True)
    worst = sorted(report.ops, key=lambda o: (-(o.n_inf + o.n_nan), -(o.underflow or 0.0), -o.amax))
    for op in sorted(worst[:12], key=lambda o: o.index):
        bad = op.n_inf or op.n_nan
        table.add_row(
            op.module or "<root>",
            op.op,
            op.dtype,
            f"{op.amax:.3g}",
            str(op.n_inf),
            str(op.n_nan),
            "" if op.underflow is None else f"{op.underflow:.1%}",
            "" if op.sqnr_db is None else f"{op.sqnr_db:.1f}",
            style="red" if bad else None,
        )
    console.print(table)
    console.print(report.summary())
    console.print(f"report: {html}")
