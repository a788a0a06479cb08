"""The errors the CLI reports in one line, without a traceback, and their exit codes."""

from __future__ import annotations

from amped.tasks.errors import RunError, UsageError

__all__ = [
    "EXIT_DIVERGED",
    "EXIT_FAILED",
    "EXIT_FLAGGED",
    "EXIT_INTERRUPTED",
    "EXIT_NO_PLAN",
    "EXIT_OK",
    "EXIT_TERMINATED",
    "EXIT_UNFIXED",
    "EXIT_USAGE",
    "RunError",
    "UsageError",
]

EXIT_OK = 0
EXIT_FAILED = 1  # RunError
EXIT_FLAGGED = 1  # amped verify: something flagged (as a linter's findings; a failure is 1 too)
EXIT_USAGE = 2  # UsageError
# 3: the numerics failed, as each command defines it (like a linter's findings).
EXIT_DIVERGED = 3  # amped compare: every recipe ran, but one or more diverged (non-finite losses)
EXIT_UNFIXED = 3  # amped doctor: a non-finite value it found no verified fix for
# amped tune: no lowered plan met the budget (the all-bf16 plan is written, with the
# reason), or the chosen plan failed its verification (written, marked failed).
EXIT_NO_PLAN = 3
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report SIGINT (128 + 2)
EXIT_TERMINATED = 143  # SIGTERM (128 + 15), handled like Ctrl-C
