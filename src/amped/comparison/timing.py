"""Step times a reader can trust: the repeats' median and quartiles, the ratio range
their IQRs allow, and how busy the machine was (docs/compare.md, "How to read the
numbers"). The first step is warm-up and is left out when there are others.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from amped._internal.stats import quartiles

__all__ = [
    "MIN_TIMED_STEPS",
    "WIDE_SPREAD",
    "CpuLoad",
    "StepStats",
    "clear_winner",
    "cores_available",
    "ratio_range",
    "speed_blocker",
    "step_stats",
]

MIN_TIMED_STEPS = 10
"""Timed steps (warm-up left out) each recipe needs before speeds are compared: with
fewer, a quartile is one or two stalls away from another value (3 timed steps once gave
a 4.5x "fastest" that 200 steps measured at 1.2-1.3x)."""

WIDE_SPREAD = 0.25
"""An IQR wider than this fraction of the median is called wide in the report."""


@dataclass(frozen=True)
class StepStats:
    """Seconds per step over ``repeats`` timed steps: median, quartiles, extremes."""

    repeats: int
    median: float
    q1: float
    q3: float
    low: float
    high: float

    @property
    def spread(self) -> float:
        """The IQR as a fraction of the median."""
        return (self.q3 - self.q1) / self.median if self.median > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "repeats": self.repeats,
            "median_s": self.median,
            "q1_s": self.q1,
            "q3_s": self.q3,
            "min_s": self.low,
            "max_s": self.high,
        }


def step_stats(step_times: list[float]) -> StepStats | None:
    """The statistics of ``step_times``, warm-up (the first step) left out; None if empty."""
    timed = step_times[1:] if len(step_times) > 1 else step_times
    if not timed:
        return None
    q1, median, q3 = quartiles(timed)
    return StepStats(len(timed), median, q1, q3, low=min(timed), high=max(timed))


def ratio_range(speed: dict[str, Any], base: dict[str, Any]) -> tuple[float, float] | None:
    """The range of ``speed / base`` the two IQRs allow (see the module docstring).

    Both arguments are ``timing`` entries of ``results.json`` (step times in seconds).
    """
    try:
        return base["q1_s"] / speed["q3_s"], base["q3_s"] / speed["q1_s"]
    except (KeyError, TypeError, ZeroDivisionError):
        return None


def speed_blocker(repeats: dict[str, int]) -> str | None:
    """Why speeds may not be compared, or None when every recipe has at least
    :data:`MIN_TIMED_STEPS` timed steps (``repeats``: recipe name -> timed steps)."""
    short = {name: count for name, count in repeats.items() if count < MIN_TIMED_STEPS}
    if not short:
        return None
    listed = ", ".join(f"{name} {count}" for name, count in short.items())
    return (
        f"too few timed steps to compare speed: {listed} (a comparison needs at least "
        f"{MIN_TIMED_STEPS} per recipe, the first step left out as warm-up); raise "
        "--max-time or --steps"
    )


def clear_winner(timings: dict[str, dict[str, Any]]) -> str | None:
    """The recipe whose slow quartile is faster than every other's fast quartile, or None."""
    ranked = sorted(timings, key=lambda name: timings[name]["median_s"])
    if len(ranked) < 2:
        return None
    best, others = ranked[0], ranked[1:]
    if all(timings[best]["q3_s"] < timings[other]["q1_s"] for other in others):
        return best
    return None


def cores_available() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


def _system_busy_seconds() -> float | None:
    """CPU seconds all processes have used since boot (``/proc/stat``), or None."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(v) for v in fields[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    guest = sum(ticks[8:10]) if len(ticks) > 9 else 0  # already counted in user/nice
    return (sum(ticks) - idle - guest) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


class CpuLoad:
    """Measures how much CPU other processes used between :meth:`start` and :meth:`stop`."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.cores = cores_available()
        self._start: tuple[float, float | None, float] | None = None

    def start(self) -> CpuLoad:
        self._start = (time.monotonic(), _system_busy_seconds(), _own_seconds())
        return self

    def stop(self) -> dict[str, Any]:
        """The load as recorded in ``results.json`` (``machine``)."""
        if self._start is None:
            raise RuntimeError("CpuLoad.stop() was called before start()")
        began, system, own = self._start
        wall = time.monotonic() - began
        now = _system_busy_seconds()
        others: float | None = None
        if system is not None and now is not None and wall > 0:
            others = max(0.0, ((now - system) - (_own_seconds() - own)) / wall)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        measure = others if others is not None else (
            None if load is None else max(0.0, load - self.threads)
        )  # fmt: skip
        busy = measure is not None and measure > self.cores - self.threads + 0.25
        return {
            "cores": self.cores,
            "threads": self.threads,
            "other_processes_cores": None if others is None else round(others, 2),
            "load_average_1min": None if load is None else round(load, 2),
            "busy": busy,
        }
