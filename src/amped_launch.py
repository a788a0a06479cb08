"""The ``amped`` console script: SIGINT and SIGTERM handled before any heavy import.

``amped.cli.main`` imports ``amped``, which imports torch (one to three seconds). With
the handlers installed there, a SIGTERM in that time killed the process by the default
action: no message, nothing written, exit status -15. This module imports only the
standard library, so the handlers are in place within milliseconds of the interpreter
starting (docs/robustness.md gives the window measured); a signal during the imports
then ends the run as one does later: one line, ``amped: error: interrupted``, exit code
128 + the signal. From ``amped.cli.main.main`` on, :mod:`amped.cli.interrupt` takes over.
"""

from __future__ import annotations

import signal
import sys

__all__ = ["main"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def main() -> int:
    """Install the handlers, import the CLI, run it; the exit code."""
    received: list[int] = []

    def interrupted(signum: int, frame: object) -> None:
        received.append(signum)
        raise KeyboardInterrupt

    for number in _SIGNALS:
        signal.signal(number, interrupted)
    try:
        from amped.cli.main import main as run_cli

        return run_cli()
    except KeyboardInterrupt:  # before the CLI's own handling began
        print("amped: error: interrupted", file=sys.stderr, flush=True)
        return 128 + int(received[0] if received else signal.SIGINT)


if __name__ == "__main__":
    sys.exit(main())
