"""Progress while ``amped tune`` measures and verifies: two rich bars, or a line per event.

``amped.tune`` reports through its ``progress(stage, done, total)`` callback, stage
``"measure"`` (layer-format measurements) or ``"train"`` (verification runs, one per
arm and seed). Each call is also where a first Ctrl-C or SIGTERM takes effect
(:func:`amped.comparison.interrupt.check`): the run stops there, between two units of work.
Both write to stderr, so ``--json`` keeps stdout for tuned.json alone.
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from amped.comparison import interrupt

__all__ = ["STAGES", "TuneLines", "TuneProgress"]

STAGES = {"measure": "measuring layers", "train": "verifying"}
"""The stages ``amped.tune`` reports, and their labels."""


class TuneProgress:
    """A bar per stage, on a terminal; a context manager, called as the callback."""

    def __init__(self, console: Console | None = None) -> None:
        self._progress = Progress(
            TextColumn("[bold]{task.description:<17}"),
            BarColumn(bar_width=32),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console or Console(stderr=True),
        )
        self._ids: dict[str, TaskID] = {}

    def __enter__(self) -> TuneProgress:
        self._progress.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._progress.stop()

    def __call__(self, stage: str, done: int, total: int) -> None:
        if stage not in self._ids:
            self._ids[stage] = self._progress.add_task(STAGES.get(stage, stage), total=total)
        self._progress.update(self._ids[stage], completed=done, total=total)
        interrupt.check()


class TuneLines:
    """A line on stderr as each stage starts and as each verification run ends (for
    logs and ``--no-progress``); called as the callback."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream or sys.stderr
        self._stage: str | None = None

    def __enter__(self) -> TuneLines:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def __call__(self, stage: str, done: int, total: int) -> None:
        label = STAGES.get(stage, stage)
        if stage != self._stage:
            self._stage = stage
            print(f"amped tune: {label} ({total})", file=self._stream, flush=True)
        if stage == "train" or done == total:
            print(f"amped tune: {label}: {done}/{total}", file=self._stream, flush=True)
        interrupt.check()
