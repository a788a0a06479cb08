"""The comparison as a rich table on the terminal, with the findings and footnotes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from amped.cli import summary

__all__ = ["print_summary"]

_LEFT = {"recipe", "flags"}
_PIPE_WIDTH = 160  # when stdout is not a terminal (a file, a pipe): wide enough for the table


def _stdout_console() -> Console:
    console = Console()
    return console if console.is_terminal else Console(width=_PIPE_WIDTH)


def build_table(results: dict[str, Any]) -> Table:
    task = results["task"] or {}
    name = task.get("name", results["config"]["task"])
    title = f"amped compare: {name} on {results['config']['device']}"
    if results["partial"]:
        title += " (partial)"
    table = Table(title=title, title_justify="left", header_style="bold", box=box.SIMPLE_HEAD)
    for (key, _), header in zip(summary.COLUMNS, summary.headers(results), strict=True):
        table.add_column(
            header, justify="left" if key in _LEFT else "right", no_wrap=key != "flags"
        )
    for recipe, row in zip(results["recipes"], summary.rows(results), strict=True):
        style = (
            "red"
            if recipe["status"] == "failed"
            else ("yellow" if recipe["slow_on_this_hardware"] else None)
        )
        table.add_row(*(row[key] for key, _ in summary.COLUMNS), style=style)
    return table


def print_summary(
    results: dict[str, Any], paths: tuple[Path, ...], console: Console | None = None
) -> None:
    """Print the table, then the findings, the footnotes and where the report is."""
    console = console or _stdout_console()
    console.print(build_table(results))
    for line in summary.footnotes(results):
        console.print(f"  {line}", style="dim", markup=False, highlight=False)
    console.print()
    for line in summary.findings(results):
        console.print(f"• {line}", markup=False, highlight=False)
    if paths:
        console.print()
        console.print("Report: " + "  ".join(str(p) for p in paths), markup=False, highlight=False)
