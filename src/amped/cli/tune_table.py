"""``amped tune`` on the terminal: the per-layer table, the verification table and the
outcome.

A row per layer in model order: its GEMM FLOPs, per candidate format the output SQNR in
dB and the estimated loss change, and the format chosen. Numbers are never squeezed; a
long layer name keeps its end (which layer it is) after an ellipsis. When stdout is a
file or a pipe the tables are laid out for :data:`PIPE_WIDTH` columns, so nothing wraps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from amped.cli import tune_summary

__all__ = ["PIPE_WIDTH", "layer_table", "print_tune", "verification_table"]

PIPE_WIDTH = 160


def _table(title: str) -> Table:
    return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, header_style="bold",
                 pad_edge=False, collapse_padding=True)  # fmt: skip


def _shorten(name: str, room: int) -> str:
    return name if len(name) <= room else "…" + name[-(room - 1) :]


def layer_table(tuned: dict[str, Any], width: int = 80) -> Table:
    """Every measured layer, in model order, sized for ``width`` columns."""
    formats = tune_summary.candidate_formats(tuned)
    rows = tune_summary.layer_rows(tuned)
    keys = ["flops", *formats, "choice"]
    headers = {"flops": "FLOPs", "choice": "choice", **{f: f for f in formats}}
    widest = {k: max([len(headers[k]), *(len(r[k]) for r in rows)]) for k in keys}
    room = max(12, width - sum(widest[k] + 2 for k in keys) - 2)
    table = _table(f"amped tune, base {tuned['base']}: per layer")
    table.caption = "cells: output SQNR dB / estimated loss change"
    table.caption_justify = "left"
    table.add_column("layer", no_wrap=True, max_width=room)
    for key in keys:
        table.add_column(headers[key], justify="left" if key == "choice" else "right",
                         no_wrap=True, min_width=widest[key])  # fmt: skip
    for row in rows:
        style = None if row["choice"] == "bf16" else "green"
        cells = [_shorten(row["layer"], room), *(row[k] for k in keys)]
        table.add_row(*cells, style=style)
    return table


def verification_table(tuned: dict[str, Any]) -> Table:
    """The verification runs: per arm the final loss of each seed, mean, std, gap to
    bf16-mixed and the verdict; the plan's row red unless it passed."""
    rows = tune_summary.verification_rows(tuned)
    verification = tuned["verification"]
    table = _table(
        f"Verification: final train loss after {verification['steps']} steps, "
        f"{len(verification['seeds'])} seeds"
    )
    for key in rows[0]:
        table.add_column(key, justify="left" if key in ("arm", "verdict") else "right",
                         no_wrap=True)  # fmt: skip
    for row in rows:
        style = None
        if row["arm"] == "plan":
            style = "bold green" if row["verdict"] == "passed" else "bold red"
        table.add_row(*row.values(), style=style)
    return table


def print_tune(
    tuned: dict[str, Any], paths: tuple[Path, ...], console: Console | None = None
) -> None:
    """Print both tables, the outcome in one sentence and where the report is."""
    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=PIPE_WIDTH)
    console.print(layer_table(tuned, width=console.width))
    console.print(verification_table(tuned))
    state = tune_summary.outcome(tuned)
    style = "bold green" if state == "passed" else "bold red"
    console.print(tune_summary.headline(tuned), style=style, markup=False, highlight=False)
    if paths:
        console.print("Report: " + "  ".join(str(p) for p in paths), markup=False, highlight=False)
