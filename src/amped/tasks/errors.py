"""The two ways a task or a comparison cannot go ahead, shared by the library and the CLI.

A :class:`UsageError` is the caller's to fix (an argument, or a task that breaks the
factory contract); a :class:`RunError` is a run that could not be done or recorded.
Each message is one line ending with ``Received: ...``. The CLI prints them without a
traceback and exits 2 and 1 (docs/robustness.md).
"""

from __future__ import annotations

__all__ = ["RunError", "TaskTypeError", "UsageError"]


class UsageError(ValueError):
    """Bad arguments, or a task that breaks the factory contract (the CLI's exit code 2)."""


class RunError(RuntimeError):
    """The run could not be done or recorded: the task failing before training, an
    unwritable report, failed recipes (the CLI's exit code 1)."""


class TaskTypeError(UsageError, TypeError):
    """A factory that returned the wrong kind of thing (not ``(model, batches, loss_fn)``
    or a ``Task``, a model that is not a ``torch.nn.Module``, ...): a usage error, and a
    ``TypeError`` as Python spells a wrong type."""
