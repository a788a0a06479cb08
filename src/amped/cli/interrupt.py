"""Ctrl-C that stops a comparison cleanly, at a step boundary.

The first SIGINT only sets a flag; the training loop checks it after every step and
raises KeyboardInterrupt there, from Python, where the comparison catches it and writes
the partial results. A second SIGINT raises at once, as Python does by default.

Why not let the first one raise: an asynchronous KeyboardInterrupt can land inside C++
code that runs Python through pybind11 (torch runs some while importing its compiler
stack during the first optimizer construction). CPython then records the interrupt as
unhandled, and although the CLI catches it and exits with 130, the interpreter kills
itself with SIGINT on the way out.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = ["check", "graceful_interrupts"]

_requested = threading.Event()


def _first_interrupt(signum: int, frame: FrameType | None) -> None:
    _requested.set()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the second one raises


def check() -> None:
    """Raise KeyboardInterrupt if Ctrl-C was pressed since the comparison started."""
    if _requested.is_set():
        raise KeyboardInterrupt


@contextmanager
def graceful_interrupts() -> Iterator[None]:
    """Defer the first Ctrl-C to the next :func:`check` (main thread only; a no-op elsewhere)."""
    _requested.clear()
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, _first_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        _requested.clear()
