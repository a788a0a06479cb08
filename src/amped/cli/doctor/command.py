"""``amped doctor``: the numerics doctor on the built-in task or a user's factory.

It checks one training step on the task's first batch, prints the worst ops, writes
``doctor.json`` and ``doctor.html`` as one set, and exits like a linter: 0 healthy or
fixed by a verified fix, :data:`~amped.cli.errors.EXIT_UNFIXED` (3) otherwise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from amped._internal.files import write_files
from amped.cli.doctor.html import doctor_html
from amped.cli.errors import EXIT_OK, EXIT_UNFIXED, RunError, UsageError
from amped.cli.out_dir import resolve_out
from amped.cli.width import table as width_table
from amped.cli.width import wrap
from amped.comparison.dtypes import parse_low_dtype
from amped.comparison.environment import default_device, resolve_device
from amped.doctor import diagnose
from amped.doctor.report import OpStat, Report
from amped.tasks.factory import DEFAULT_FACTORY, load_factory
from amped.tasks.task import to_device

__all__ = ["doctor_table", "run_doctor", "unfixed_nonfinite"]

_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}  # the table's dtype column


def run_doctor(args: argparse.Namespace) -> int:
    """Run ``amped doctor``; returns the exit code (raises UsageError / RunError)."""
    if args.replay is not None:
        from amped.cli.doctor.replay import run_replay

        return run_replay(args)
    dtype = parse_low_dtype(args.dtype)
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
            dtype=dtype,
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
        document, page = report.to_json(), doctor_html(report)
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
    if unfixed_nonfinite(report):
        print(
            "amped doctor: non-finite values (inf/NaN) and no verified fix: exit status "
            f"{EXIT_UNFIXED}",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_UNFIXED
    return EXIT_OK


def unfixed_nonfinite(report: Report) -> bool:
    """Whether the step produced inf/NaN and the doctor has no verified fix for it."""
    nonfinite = (
        report.forward_culprit is not None
        or report.backward_culprit is not None
        or any(report.nonfinite_grads.values())
        or any(op.n_inf or op.n_nan for op in report.ops)
    )
    fixed = report.suggestion is not None and report.suggestion.verified
    return nonfinite and not fixed


def doctor_table(report: Report, rows: int = 12, width: int = 80) -> Table:
    """The ``rows`` ops with the most inf/NaN, then underflow, then range, in run order.

    Sized for ``width`` columns: short dtype names, no cell wraps (a long module name
    keeps its end, after an ellipsis, on a narrow terminal; ``doctor.json`` has it whole).
    """
    where = f"{report.dtype} on {report.device_type}"
    table = width_table(f"amped doctor: {where}, policy {report.policy.name!r}")
    worst = sorted(report.ops, key=lambda o: (-(o.n_inf + o.n_nan), -(o.underflow or 0.0), -o.amax))
    cells = [_cells(op) for op in sorted(worst[:rows], key=lambda o: o.index)]
    headers = ("module", "op", "dtype", "max |x|", "inf", "NaN", "underflow", "SQNR dB")
    widest = [max([len(h), *(len(c[i]) for c, _ in cells)]) for i, h in enumerate(headers)]
    # Each column costs its text plus 2 (collapsed padding). The numbers are never
    # squeezed; the names share what is left, the op name taking at most half.
    room = max(16, width - sum(w + 2 for w in widest[2:]) - 6)
    op_room = min(widest[1], max(8, room // 2))
    module_room = max(8, room - op_room)
    table.add_column(headers[0], no_wrap=True, max_width=module_room)
    table.add_column(headers[1], no_wrap=True, max_width=op_room)
    for index, column in enumerate(headers[2:], start=2):
        table.add_column(column, justify="right", no_wrap=True, min_width=widest[index])
    for (module, op, *rest), bad in cells:
        # A module name keeps its end (which module it is), an op name its start.
        module = module if len(module) <= module_room else "…" + module[-(module_room - 1) :]
        op = op if len(op) <= op_room else op[: op_room - 1] + "…"
        table.add_row(module, op, *rest, style="red" if bad else None)
    return table


def _cells(op: OpStat) -> tuple[tuple[str, ...], bool]:
    row = (
        op.module or "<root>",
        op.op,
        _SHORT.get(op.dtype, op.dtype),
        f"{op.amax:.3g}",
        str(op.n_inf),
        str(op.n_nan),
        "" if op.underflow is None else f"{op.underflow:.1%}",
        "" if op.sqnr_db is None else f"{op.sqnr_db:.1f}",
    )
    return row, bool(op.n_inf or op.n_nan)


def _print(report: Report, html: Path) -> None:
    console = Console()  # on a pipe: 80 columns, or COLUMNS
    console.print(doctor_table(report, width=console.width))
    for line in report.summary().splitlines():
        # The fix is a line of code to paste: whole, however long; the rest wrapped.
        text = line if line.lstrip().startswith("fix: ") else wrap(line, console.width, "    ")
        console.print(text, markup=False, highlight=False, soft_wrap=True)
    console.print(f"report: {html}", markup=False, highlight=False, soft_wrap=True)
