"""The errors the CLI reports in one line, without a traceback, and their exit codes."""

from __future__ import annotations

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_UNFIXED",
    "EXIT_USAGE",
    "RunError",
    "UsageError",
]

EXIT_OK = 0
EXIT_FAILED = 1  # RunError
EXIT_USAGE = 2  # UsageError
EXIT_UNFIXED = 3  # amped doctor: a non-finite value it found no verified fix for (like a linter)
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report SIGINT (128 + 2)


class UsageError(Exception):
    """Bad arguments or a task that breaks the factory contract (exit code 2).

    The message is one line, Keras-style: what happened, what was expected, how to
    fix it, ending with ``Received: ...``.
    """


class RunError(Exception):
    """The run could not be done or recorded: a missing extra, an unwritable report,
    failed recipes (exit code 1)."""
