"""Progress while a comparison runs: a rich bar per recipe, or one line per recipe event.

Both write to stderr, so ``--json`` keeps stdout for the results alone. Bars are used
on a terminal; elsewhere (logs, CI, ``--no-progress``) a line per recipe start and end.
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

from amped._internal.stats import median
from amped.cli.width import wrap
from amped.comparison.run import LOSS_WINDOW, Observer, RecipeRun, final_loss
from amped.comparison.summary import loss_decimals
from amped.comparison.warmup import Warmup, expected

__all__ = ["LineProgress", "RichProgress"]

_RECENT = 10  # steps the displayed throughput is the median over


def _recent_speed(run: RecipeRun) -> float | None:
    if not run.step_times:
        return None
    step = median(run.step_times[-_RECENT:])
    return run.samples / len(run.step_times) / step if step > 0 else None


def _outcome(run: RecipeRun) -> str:
    if run.status == "failed":
        return f"failed: {run.error}"
    if run.status == "stopped":
        return f"stopped ({run.stop_reason})"
    return run.status


class RichProgress(Observer):
    """One bar per recipe, with step, loss and throughput; a context manager."""

    def __init__(self, names: list[str], steps: int, console: Console | None = None) -> None:
        self._progress = Progress(
            TextColumn("[bold]{task.fields[recipe]:<14}"),
            BarColumn(bar_width=28),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:>6}"),
            TextColumn("{task.fields[speed]:>7} samples/s"),
            TimeElapsedColumn(),
            TextColumn("{task.fields[state]}"),
            console=console or Console(stderr=True),
        )
        self._ids: dict[str, TaskID] = {
            name: self._progress.add_task(
                name, total=steps, start=False, recipe=name, loss="—", speed="—", state="waiting"
            )
            for name in names
        }

    def __enter__(self) -> RichProgress:
        self._progress.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._progress.stop()

    def warming_up(self, run: RecipeRun, compiles: str | None) -> None:
        state = f"compiling {compiles}" if compiles else "warm-up"
        when = expected(compiles)
        if when:  # a long first compile is said before it starts, above the bars
            self._progress.console.print(f"{run.recipe.name}: {state} ({when})", markup=False)
        self._progress.update(self._ids[run.recipe.name], state=state)

    def warmed_up(self, run: RecipeRun, warmup: Warmup) -> None:
        state = warmup.line() if run.status != "failed" else _outcome(run)
        self._progress.update(self._ids[run.recipe.name], state=state)

    def planning(self, runs: list[RecipeRun]) -> None:
        for task in self._ids.values():
            self._progress.update(task, state="timing a few steps")

    def probing(self, run: RecipeRun) -> None:
        self._progress.update(self._ids[run.recipe.name], state="peak memory, own process")

    def planned(self, runs: list[RecipeRun], note: str) -> None:
        self._progress.console.print(f"[dim]{note}[/dim]", highlight=False)
        for run in runs:
            state = "waiting" if run.status == "not_run" else _outcome(run)
            self._progress.update(self._ids[run.recipe.name], total=run.steps_planned, state=state)

    def recipe_started(self, run: RecipeRun) -> None:
        task = self._ids[run.recipe.name]
        self._progress.start_task(task)
        self._progress.update(task, state="running")

    def step_done(self, run: RecipeRun) -> None:
        speed = _recent_speed(run)
        self._progress.update(
            self._ids[run.recipe.name],
            completed=len(run.step_times),
            loss=f"{run.losses[-1]:.{loss_decimals(run.losses[-1:])}f}",
            speed=f"{speed:,.0f}" if speed else "—",
        )

    def recipe_finished(self, run: RecipeRun) -> None:
        task = self._ids[run.recipe.name]
        self._progress.update(task, state=_outcome(run))
        self._progress.stop_task(task)


class LineProgress(Observer):
    """A line on stderr when each recipe starts and ends (for logs and --no-progress)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream or sys.stderr

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def _say(self, text: str) -> None:
        print(wrap(text), file=self._stream, flush=True)

    def warming_up(self, run: RecipeRun, compiles: str | None) -> None:
        if compiles:
            when = expected(compiles)
            cost = f"{when}; " if when else ""
            self._say(f"{run.recipe.name}: compiling {compiles} ({cost}outside --max-time)")

    def warmed_up(self, run: RecipeRun, warmup: Warmup) -> None:
        if run.status == "failed":
            self._say(f"{run.recipe.name}: {_outcome(run)} in its warm-up steps")
        elif warmup.compiles:
            self._say(f"{run.recipe.name}: {warmup.line()}")

    def planning(self, runs: list[RecipeRun]) -> None:
        self._say("timing a few steps of each recipe to fit --max-time")

    def probing(self, run: RecipeRun) -> None:
        self._say(f"{run.recipe.name}: measuring peak memory in a process of its own")

    def planned(self, runs: list[RecipeRun], note: str) -> None:
        self._say(note)

    def recipe_started(self, run: RecipeRun) -> None:
        self._say(f"{run.recipe.name}: running {run.steps_planned} steps")

    def recipe_finished(self, run: RecipeRun) -> None:
        # The same figures, by the same definitions, as results.json's final_train_loss
        # and samples_per_s.
        speed = run.samples_per_s()
        final = final_loss(run.losses)
        loss = ""
        if final is not None:
            window = min(LOSS_WINDOW, len(run.losses))
            digits = loss_decimals([final])
            loss = f", final train loss {final:.{digits}f} (mean of the last {window} steps)"
        rate = f", {speed:,.0f} samples/s" if speed else ""
        self._say(f"{run.recipe.name}: {_outcome(run)} after {len(run.losses)} steps{loss}{rate}")
