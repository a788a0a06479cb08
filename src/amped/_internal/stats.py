"""Summaries of repeated measurements (step times, benchmark repeats)."""

from __future__ import annotations

import statistics
from collections.abc import Iterable

__all__ = ["iqr", "median", "quartiles"]


def quartiles(values: Iterable[float]) -> tuple[float, float, float]:
    """``(q1, median, q3)`` by linear interpolation between closest ranks.

    This is ``statistics.quantiles(method="inclusive")``, numpy's default method. One
    value gives that value three times. Raises ``ValueError`` for no values.
    """
    data = list(values)
    if not data:
        raise ValueError("quartiles need at least one value. Received: no values")
    if len(data) == 1:
        return data[0], data[0], data[0]
    q1, q2, q3 = statistics.quantiles(data, n=4, method="inclusive")
    return q1, q2, q3


def median(values: Iterable[float]) -> float:
    """The median (the mean of the two middle values for an even count)."""
    data = list(values)
    if not data:
        raise ValueError("a median needs at least one value. Received: no values")
    return statistics.median(data)


def iqr(values: Iterable[float]) -> float:
    """The interquartile range, ``q3 - q1``."""
    q1, _, q3 = quartiles(values)
    return q3 - q1
