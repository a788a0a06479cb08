"""``amped verify``: one training step of a task through a backend, checked against
amped's reference for a recipe (:func:`amped.verify`).

It prints a table of every GEMM (within 80 columns), writes ``verify.json`` and
``verify.html`` as one set, and exits 0 when nothing is flagged,
:data:`~amped.cli.errors.EXIT_FLAGGED` (1) when something is, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from amped._internal.files import write_files
from amped.cli.errors import EXIT_FLAGGED, EXIT_OK, RunError, UsageError
from amped.cli.out_dir import resolve_out
from amped.cli.verify.html import verify_html
from amped.cli.width import table as width_table
from amped.cli.width import wrap
from amped.comparison.environment import default_device, resolve_device
from amped.tasks.factory import DEFAULT_FACTORY, load_factory
from amped.tasks.task import to_device
from amped.verification import VerifyReport, verify

__all__ = ["run_verify", "verify_table"]

_SCALING = {"tensorwise": "tw", "rowwise": "row", "columnwise": "col", "none": ""}
_DTYPES = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}


def run_verify(args: argparse.Namespace) -> int:
    """Run ``amped verify``; returns the exit code (raises UsageError / RunError)."""
    device = resolve_device(args.device or default_device())
    factory = load_factory(args.model or DEFAULT_FACTORY)
    task = factory.check(batch_size=args.batch_size, seed=args.seed, device=device)
    out = resolve_out(args.out)
    batch = to_device(next(iter(task.batches)), device)
    threads = torch.get_num_threads()
    try:
        if task.threads:  # the task's choice (the built-in one: 1)
            torch.set_num_threads(task.threads)
        report = verify(
            task.model.to(device),
            batch,
            recipe=args.recipe,
            backend=args.backend,
            loss_fn=task.loss_fn,
        )
    except ValueError as error:
        raise UsageError(str(error)) from error
    except Exception as error:
        raise RunError(f"amped verify failed: {type(error).__name__}: {error}") from error
    finally:
        torch.set_num_threads(threads)  # main() may be called in process, e.g. by tests
    document = json.dumps(report.to_dict(), indent=1)
    page = out / "verify.html"
    try:
        write_files([(out / "verify.json", document + "\n"), (page, verify_html(report))])
    except OSError as error:
        raise RunError(f"Could not write the report into {str(out)!r}: {error}") from None
    if args.json:
        sys.stdout.write(document + "\n")
    else:
        _print(report, page)
    return EXIT_OK if report.ok else EXIT_FLAGGED


def _short(ran: str) -> str:
    """``"e4m3 rowwise, float32 scale"`` -> ``"e4m3 row"``; a high-precision operand:
    its dtype."""
    element, _, rest = ran.partition(" ")
    scaling = rest.split(",")[0]
    if scaling.startswith("(no"):
        return _DTYPES.get(element, element)
    return f"{element} {_SCALING.get(scaling, scaling.replace('block', 'b'))}"


def verify_table(report: VerifyReport, width: int = 80) -> Table:
    """One row per GEMM: layer, role, each operand's format, whether the casts are the
    reference's bit for bit, the worst error over its bound, and a flag mark. Sized for
    ``width`` columns: a long layer name keeps its end after an ellipsis."""
    table = width_table(f"amped verify: {report.backend} against {report.recipe}")
    flagged = {(f.layer, f.role) for f in report.flags}
    rows = []
    for g in report.gemms:
        a, b = (_short(c.ran) for c in g.casts) if g.casts else ("", "")
        bitwise = "" if not g.casts else "yes" if all(c.mismatched == 0 for c in g.casts) else "no"
        ratio = "" if not g.casts else f"{g.max_ratio:.2f}"
        mark = "FLAG" if (g.layer, g.role) in flagged else "ok"
        rows.append((g.layer, g.role, a, b, bitwise, ratio, mark))
    headers = ("layer", "role", "A", "B", "bitwise", "err/bound", "")
    widest = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    room = max(10, width - sum(w + 2 for w in widest[1:]) - 2)
    table.add_column(headers[0], no_wrap=True, max_width=room)
    for index, header in enumerate(headers[1:], start=1):
        table.add_column(header, no_wrap=True, justify="right" if index >= 4 else "left")
    for layer, *rest in rows:
        layer = layer if len(layer) <= room else "…" + layer[-(room - 1) :]
        table.add_row(layer, *rest, style="red" if rest[-1] == "FLAG" else None)
    return table


def _print(report: VerifyReport, page: Path) -> None:
    console = Console()  # on a pipe: 80 columns, or COLUMNS
    console.print(verify_table(report, width=min(console.width, 80)))
    if report.ok:
        line = "no flags: every cast bit for bit, every GEMM within its bound"
        console.print(line, markup=False, highlight=False)
    for flag in report.flags:
        console.print(wrap(str(flag), console.width, "    "), markup=False, highlight=False)
    console.print(f"report: {page}", markup=False, highlight=False, soft_wrap=True)
