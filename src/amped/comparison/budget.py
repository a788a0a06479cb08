"""``--max-time``: one clock for the whole comparison, probes included.

The budget runs from the first probe to the last training step; every phase asks it
how long it may take::

    warm-up   not counted: each recipe's first steps and compiles
              (:mod:`amped.comparison.warmup`), and the compiles a probe's process repeats
    probes    at most PROBE_SHARE of the budget, judged from the probes so far;
              if they do not all fit, every recipe's peak is measured in process
    timing    the recipes the probes did not time run TIMING steps, each within
              its share of what is left
    training  each recipe within its share of what is left, weighted by its
              estimated step time: share_i = left * est_i / sum(est of those left)

A step is started only if the last one's time still fits the share, and each recipe
runs at least one step (there is nothing to report otherwise): a budget shorter than
one step of each recipe is overrun by that much, and the report says so. Rendering
the report comes after the budget (a second or two).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PROBE_SHARE", "Budget"]

PROBE_SHARE = 1 / 3
"""The fraction of ``--max-time`` own-process memory probes may take, all together."""


@dataclass
class Budget:
    """The deadline of one comparison (``max_time`` None: no limit), and what it cut."""

    max_time: float | None
    started: float = field(default_factory=time.monotonic)
    cut: list[str] = field(default_factory=list)
    spent: float | None = None  # seconds from start to the last step, once stopped
    excluded: float = 0.0  # seconds not counted: warm-up and compiles

    @property
    def limited(self) -> bool:
        return self.max_time is not None

    def elapsed(self) -> float:
        """Seconds counted so far: since the start, less those left out by :meth:`exclude`."""
        return time.monotonic() - self.started - self.excluded

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` (a warm-up, a compile) out of the budget."""
        self.excluded += max(0.0, seconds)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """The clock stopped while the block runs (the warm-up phase)."""
        began = time.monotonic()
        try:
            yield
        finally:
            self.exclude(time.monotonic() - began)

    def left(self) -> float:
        """Seconds left (infinite without a limit; never negative)."""
        if self.max_time is None:
            return float("inf")
        return max(0.0, self.max_time - self.elapsed())

    def probe_left(self) -> float:
        """Seconds the probes may still take (all probes together)."""
        if self.max_time is None:
            return float("inf")
        return max(0.0, PROBE_SHARE * self.max_time - self.elapsed())

    def share(self, estimate: float, estimates_left: float) -> float | None:
        """The deadline (a ``time.monotonic()`` value) of a phase whose step takes
        about ``estimate`` seconds, among phases whose steps take ``estimates_left``
        together (``estimate`` included); None without a limit."""
        if self.max_time is None:
            return None
        fraction = estimate / estimates_left if estimates_left > 0 else 1.0
        return time.monotonic() + self.left() * min(1.0, fraction)

    def stop(self) -> None:
        """Mark the end of training: what the report says was spent."""
        self.spent = self.elapsed()

    def note_cut(self, text: str) -> None:
        """Record one thing the budget cut, as a sentence for the report."""
        if text not in self.cut:
            self.cut.append(text)

    def as_dict(self) -> dict[str, Any] | None:
        """The budget as recorded in ``results.json`` (``budget``); None without a limit."""
        if self.max_time is None:
            return None
        return {
            "max_time_s": self.max_time,
            "spent_s": round(self.spent if self.spent is not None else self.elapsed(), 3),
            "excluded_s": round(self.excluded, 3),
            "cut": list(self.cut),
        }
