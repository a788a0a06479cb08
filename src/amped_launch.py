"""The ``amped`` console script: SIGINT and SIGTERM handled before any heavy import.

``amped.cli.main`` imports ``amped``, which imports torch (one to three seconds). With
the handlers installed there, a SIGTERM in that time killed the process by the default
action: no message, nothing written, exit status -15. This module imports only the
standard library, so the handlers are in place within milliseconds of the interpreter
starting (docs/robustness.md gives the window measured).

A signal is not allowed to interrupt the imports themselves: a KeyboardInterrupt raised
inside a third-party import can be swallowed by that library's own ``try``, leaving a
half-initialised module behind (seen: numpy without ``subtract`` under torch's import,
then matplotlib failing with an unrelated ValueError). So both signals are blocked
while the CLI and its heavy dependencies are imported, and delivered as the block is
lifted: the run then ends as one does later, with one line, ``amped: error:
interrupted``, and exit code 128 + the signal. From ``amped.cli.main.main`` on,
:mod:`amped.comparison.interrupt` takes over.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Callable

__all__ = ["main"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Imported with the signals held: the CLI, then its optional extras where installed
# (a missing one is reported by the CLI itself, with what to install).
_OPTIONAL = ("rich.console", "rich.table", "matplotlib", "matplotlib.figure")


def _import_cli() -> Callable[[], int]:
    from amped.cli.main import main as run_cli

    for name in _OPTIONAL:
        with contextlib.suppress(ImportError):
            __import__(name)
    return run_cli


def main() -> int:
    """Install the handlers, import the CLI with the signals held, run it; the exit code."""
    received: list[int] = []

    def interrupted(signum: int, frame: object) -> None:
        received.append(signum)
        raise KeyboardInterrupt

    for number in _SIGNALS:
        signal.signal(number, interrupted)
    can_hold = hasattr(signal, "pthread_sigmask")  # POSIX; elsewhere a signal raises at once
    try:
        if can_hold:
            signal.pthread_sigmask(signal.SIG_BLOCK, set(_SIGNALS))
        try:
            run_cli = _import_cli()
        finally:
            if can_hold:  # a signal held during the imports is delivered here
                signal.pthread_sigmask(signal.SIG_UNBLOCK, set(_SIGNALS))
        return run_cli()
    except KeyboardInterrupt:  # before the CLI's own handling began
        print("amped: error: interrupted", file=sys.stderr, flush=True)
        return 128 + int(received[0] if received else signal.SIGINT)


if __name__ == "__main__":
    sys.exit(main())
