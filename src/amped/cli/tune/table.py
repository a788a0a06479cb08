"""``amped tune`` on the terminal: the per-layer table, the verification table and the
outcome.

A row per layer in model order: its GEMM FLOPs, per candidate format the output SQNR in
dB and the estimated loss change, and the format chosen. Numbers are never squeezed: the
formats that do not fit the terminal go to a second table (and a third), and a long
layer name keeps its end (which layer it is) after an ellipsis. When stdout is a file or
a pipe the tables are laid out for :data:`PIPE_WIDTH` columns (or ``COLUMNS``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from amped.cli.width import table as width_table
from amped.tuning import summary as tune_summary

__all__ = ["PIPE_WIDTH", "layer_tables", "print_tune", "verification_table"]

PIPE_WIDTH = 80


def _shorten(name: str, room: int) -> str:
    return name if len(name) <= room else "…" + name[-(room - 1) :]


def layer_tables(tuned: dict[str, Any], width: int = 80) -> list[Table]:
    """Every measured layer, in model order, sized for ``width`` columns: one table, or
    as many as it takes to show every format's column whole (each with the layer, its
    FLOPs and the choice)."""
    rows = tune_summary.layer_rows(tuned)
    formats = tune_summary.candidate_formats(tuned)
    widest = {k: max([len(k), *(len(r[k]) for r in rows)]) for k in ["choice", *formats]}
    flops = max([len("FLOPs"), *(len(r["flops"]) for r in rows)])
    names = max([len("layer"), *(len(r["layer"]) for r in rows)])
    room = min(names, max(16, width // 4))  # what the layer names may take
    fixed = room + flops + widest["choice"] + 3 * 2  # each column's text and padding
    groups: list[list[str]] = [[]]
    used = fixed
    for fmt in formats:
        if groups[-1] and used + widest[fmt] + 2 > width:
            groups.append([])
            used = fixed
        groups[-1].append(fmt)
        used += widest[fmt] + 2
    tables = []
    for index, group in enumerate(groups):
        part = f" ({index + 1}/{len(groups)})" if len(groups) > 1 else ""
        table = width_table(f"amped tune, base {tuned['base']}: per layer{part}")
        table.add_column("layer", no_wrap=True, min_width=room, max_width=room)
        table.add_column("FLOPs", justify="right", no_wrap=True, min_width=flops)
        for key in [*group, "choice"]:
            table.add_column(key, justify="left" if key == "choice" else "right",
                             no_wrap=True, min_width=widest[key])  # fmt: skip
        for row in rows:
            style = None if row["choice"] == "bf16" else "green"
            cells = [_shorten(row["layer"], room), row["flops"], *(row[k] for k in group)]
            table.add_row(*cells, row["choice"], style=style)
        tables.append(table)
    tables[-1].caption = "cells: output SQNR dB / estimated loss change"
    tables[-1].caption_justify = "left"
    return tables


def attention_table(tuned: dict[str, Any]) -> Table:
    """The attention roles tried (``tune --attention``), in the order they are lowered;
    the roles kept low in green."""
    table = width_table("Attention roles, in the order they are lowered")
    rows = tune_summary.attention_rows(tuned)
    for key in rows[0]:
        table.add_column(key, justify="left" if key in ("role", "rule", "choice") else "right")
    for row in rows:
        table.add_row(*row.values(), style=None if row["choice"] == "bf16" else "green")
    table.caption = "sqnr: the worst of out, dQ, dK, dV over the attention modules"
    table.caption_justify = "left"
    return table


def verification_table(tuned: dict[str, Any]) -> Table:
    """The verification runs: per arm the final loss of each seed, mean, std, gap to
    bf16-mixed and the verdict; the plan's row red unless it passed. (What each arm
    lowers is in the layer table and tune.html; left out here, the table fits 80
    columns up to 3 seeds.)"""
    rows = tune_summary.verification_rows(tuned)
    verification = tuned["verification"]
    table = width_table(
        f"Verification: final train loss after {verification['steps']} steps, "
        f"{len(verification['seeds'])} seeds"
    )
    keys = [key for key in rows[0] if key != "lowered"]
    for key in keys:
        widest = max([len(key), *(len(row[key]) for row in rows)])
        table.add_column(key, justify="left" if key in ("arm", "verdict") else "right",
                         no_wrap=True, min_width=widest)  # fmt: skip
    table.caption = tune_summary.rule_text(tuned)
    table.caption_justify = "left"
    for row in rows:
        style = None
        if row["arm"] == "plan":
            style = "bold green" if row["verdict"] == "passed" else "bold red"
        table.add_row(*(row[key] for key in keys), style=style)
    return table


def rounds_table(tuned: dict[str, Any]) -> Table:
    """The verification rounds along the estimate's order of plans, then the rule
    candidates, in the order trained; failed rounds red, the plan kept marked."""
    rows = tune_summary.round_rows(tuned)
    title = "Rounds: the estimate's plans, then the rules that could beat the best"
    if tuned.get("attention_tuning") is not None:
        title += ", then the attention roles"
    table = width_table(title)
    for key in ("round", "source", "lowered", "formats", "estimate", "gap", "verdict", "chosen"):
        # The formats wrap (at their commas) where 80 columns are too few; the rest not.
        table.add_column(key, justify="left" if key in ("formats", "verdict", "chosen") else
                         "right", no_wrap=key != "formats")  # fmt: skip
    for row in rows:
        style = "green" if row["verdict"] == "passed" else "red"
        table.add_row(*row.values(), style=style)
    return table


def print_tune(
    tuned: dict[str, Any], paths: tuple[Path, ...], console: Console | None = None
) -> None:
    """Print both tables, the outcome in one sentence and where the report is."""
    if console is None:
        console = Console()  # on a pipe: PIPE_WIDTH (rich's default), or COLUMNS
    for table in layer_tables(tuned, width=console.width):
        console.print(table)
    if tune_summary.attention_rows(tuned):
        console.print(attention_table(tuned))
    console.print(verification_table(tuned))
    if tuned["rounds"]:
        console.print(rounds_table(tuned))
    state = tune_summary.outcome(tuned)
    style = "bold green" if state == "passed" else "bold red"
    console.print(tune_summary.headline(tuned), style=style, markup=False, highlight=False)
    if paths:
        console.print("Report: " + "  ".join(str(p) for p in paths), markup=False, highlight=False)
