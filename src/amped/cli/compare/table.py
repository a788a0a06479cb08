"""The comparison on the terminal: warnings, two tables, footnotes, findings.

The columns come as two tables (speed and memory; loss), so each stays readable at
80 columns; when stdout is a file or a pipe, rich lays them out for 80 columns too
(or ``$COLUMNS``). No cell wraps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from amped.cli.width import table as width_table
from amped.comparison import summary
from amped.comparison.findings import warnings

__all__ = ["build_tables", "print_summary"]

_LEFT = {"recipe", "flags"}


def build_tables(results: dict[str, Any]) -> list[Table]:
    """One table per :data:`summary.GROUPS` entry, with the recipes as rows."""
    title = summary.title(results)
    headers = dict(zip((k for k, _ in summary.COLUMNS), summary.headers(results), strict=True))
    rows = summary.rows(results)
    tables = []
    for index, (group, keys) in enumerate(summary.GROUPS):
        heading = f"{title}\n{group}" if index == 0 else group
        table = width_table(heading)
        for key in keys:
            table.add_column(
                headers[key],
                justify="left" if key in _LEFT else "right",
                no_wrap=True,
            )
        for recipe, row in zip(results["recipes"], rows, strict=True):
            style = (
                "red"
                if recipe["status"] == "failed"
                else ("yellow" if recipe["slow_on_this_hardware"] else None)
            )
            table.add_row(*(row[key] for key in keys), style=style)
        tables.append(table)
    return tables


def print_summary(
    results: dict[str, Any], paths: tuple[Path, ...], console: Console | None = None
) -> None:
    """Print the warnings, the tables, the footnotes, the findings and where the report is."""
    console = console or Console()
    for line in warnings(results):
        console.print(f"warning: {line}", style="bold yellow", markup=False, highlight=False)
    for table in build_tables(results):
        console.print(table)
    for line in summary.footnotes(results):  # a hanging indent where a line wraps
        console.print(Padding(Text(line, style="dim"), (0, 0, 0, 2)))
    console.print()
    for line in summary.findings(results):
        if line not in warnings(results):
            console.print(f"• {line}", markup=False, highlight=False)
    if paths:
        console.print()
        console.print("Report: " + "  ".join(str(p) for p in paths), markup=False, highlight=False)
