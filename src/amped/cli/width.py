"""Every line the CLI writes fits :data:`WIDTH` columns when piped (README, "Output").

Tables are laid out by rich for the console's width (80 on a pipe, unless ``COLUMNS``
says otherwise), every command's in one style (:func:`table`). Sentences (errors,
progress lines, the doctor's summary) are wrapped here at word boundaries, each
continuation line indented, so a log reader still sees where one message ends: joined
with single spaces, the lines give the message back.
"""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["WIDTH", "table", "wrap"]

WIDTH = 80


def wrap(text: str, width: int = WIDTH, indent: str = "  ") -> str:
    """``text``, one line or several, each wrapped at ``width`` columns; continuation
    lines take the line's own leading spaces plus ``indent``. Words longer than a line
    (a path, a line of code) are kept whole."""
    lines = []
    for line in text.splitlines() or [""]:
        lead = line[: len(line) - len(line.lstrip())]
        lines.append(
            textwrap.fill(
                line.strip(),
                width,
                initial_indent=lead,
                subsequent_indent=lead + indent,
                break_long_words=False,
                break_on_hyphens=False,
            )
            or lead
        )
    return "\n".join(lines)


def table(title: str) -> Table:
    """An empty rich table in the style of every command's: title on the left, a rule
    under the bold header, no outer padding, one space between columns."""
    from rich import box
    from rich.table import Table

    return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, header_style="bold",
                 pad_edge=False, collapse_padding=True)  # fmt: skip
