"""Ctrl-C and SIGTERM that stop a comparison cleanly, at a step boundary.

Inside :func:`graceful_interrupts` the first signal only sets a flag, which the training
loop checks after each step (a KeyboardInterrupt raised inside torch's C++ can kill the
interpreter; docs/robustness.md); a second one raises at once. Exit code: 128 + signal.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

__all__ = [
    "SIGNALS",
    "check",
    "exit_code",
    "graceful_interrupts",
    "immediate_interrupts",
    "show_written",
]

SIGNALS = (signal.SIGINT, signal.SIGTERM)

_requested = threading.Event()
_state: dict[str, Any] = {"depth": 0, "signum": None}


def _record(signum: int) -> None:
    if _state["signum"] is None:
        _state["signum"] = signum


def _raise_now(signum: int, frame: FrameType | None) -> None:
    _record(signum)
    raise KeyboardInterrupt


def _first_interrupt(signum: int, frame: FrameType | None) -> None:
    _record(signum)
    _requested.set()
    for number in SIGNALS:  # the second one, of either kind, raises
        signal.signal(number, _raise_now)


def check() -> None:
    """Raise KeyboardInterrupt if SIGINT or SIGTERM arrived since the comparison started."""
    if _requested.is_set():
        raise KeyboardInterrupt


def requested() -> bool:
    """Whether a signal arrived inside :func:`graceful_interrupts` (without raising)."""
    return _requested.is_set()


def show_written(show: Callable[[], None]) -> bool:
    """Run ``show`` (the terminal summary of a report already written, inside
    :func:`graceful_interrupts`) and return whether a signal arrived: deferred, or the
    second one raising while it printed. Either way the report is on disk, so the
    caller says "interrupted", not that the run failed."""
    try:
        show()
    except KeyboardInterrupt:
        return True
    return requested()


def exit_code(default: int = 130) -> int:
    """128 + the number of the first signal received (``default`` if none was)."""
    signum = _state["signum"]
    return default if signum is None else 128 + int(signum)


def immediate_interrupts() -> None:
    """Make SIGTERM raise KeyboardInterrupt like SIGINT does (main thread only), and
    forget earlier signals; called once as the CLI starts."""
    _state["signum"] = None
    _requested.clear()
    if threading.current_thread() is threading.main_thread():
        for number in SIGNALS:
            signal.signal(number, _raise_now)


@contextmanager
def graceful_interrupts() -> Iterator[None]:
    """Defer the first SIGINT/SIGTERM to the next :func:`check` (main thread only; a
    no-op elsewhere). Nested uses share the outermost one's flag."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _state["depth"]:
        _state["depth"] += 1
        try:
            yield
        finally:
            _state["depth"] -= 1
        return
    _requested.clear()
    previous = {number: signal.signal(number, _first_interrupt) for number in SIGNALS}
    _state["depth"] = 1
    try:
        yield
    finally:
        _state["depth"] = 0
        for number, handler in previous.items():
            signal.signal(number, handler)
        _requested.clear()
