"""Checkpoints written atomically and read back only when whole.

:func:`save_checkpoint` writes with ``torch.save`` to a temporary file in the target's
directory, flushes it to disk and renames it over the target, so a crash (even
SIGKILL) leaves either the old file or the new one, never a mix. The temporary file is
named ``.<name>.<pid>.<random>.tmp`` and locked while it is written; each save removes
the temporaries of earlier saves of the same file whose writer died (their lock is
free and their process gone), so killed saves do not pile up. A write error (a full
disk, a file-size limit) is raised as the ``OSError`` it is.

:func:`load_checkpoint` checks the whole file before unpickling (see
:mod:`amped.checkpoint.archive`): it accepts only the zip layout ``torch.save`` writes,
with every member stored and its CRC-32 right, and then loads with
``weights_only=True`` from the same open file. Any flaw, wherever it is, raises
:class:`CheckpointError` with the cause; nothing is loaded from a damaged file. The
files are plain torch checkpoints either way.

Example:
    >>> import os, tempfile, torch
    >>> from amped.scaling import load_checkpoint, save_checkpoint
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
    >>> save_checkpoint(path, step=3, weight=torch.ones(2))
    >>> load_checkpoint(path)["step"]
    3
"""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
import time
from typing import Any, BinaryIO

import torch

from amped._internal.files import fsync_directory
from amped.checkpoint.archive import ArchiveError, verify_archive
from amped.checkpoint.finite import first_nonfinite, nonfinite_message

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "CheckpointError",
    "load_checkpoint",
    "refuse_nonfinite",
    "refused_object_error",
    "remove_stale_temporaries",
    "save_checkpoint",
]

_ADVICE = "Nothing was loaded; resume from an earlier checkpoint."
# A temporary whose writer's pid now names another process is removed only when older
# than this: no save of a checkpoint takes an hour, and pid reuse is rare.
_REUSED_PID_AGE_S = 3600.0


class CheckpointError(RuntimeError):
    """A checkpoint file is torn, truncated or corrupt (nothing was loaded from it), or
    a state to save holds an inf or NaN (nothing was written)."""


def refuse_nonfinite(state: Any, where: str, root: str = "state") -> None:
    """Raise :class:`CheckpointError` naming the first floating tensor of ``state`` that
    holds an inf or NaN. Syncs once per device.

    Args:
        state: what is about to be written (nested dicts, lists, tuples of tensors).
        where: the file or checkpoint, for the message.
        root: how the message names ``state`` itself.
    """
    found = first_nonfinite(state, root)
    if found is None:
        return
    raise CheckpointError(
        f"Refusing to write {where}: {nonfinite_message(*found)}. A checkpoint with "
        "non-finite parameters or optimizer state poisons every run resumed from it. "
        "Resume from the last good checkpoint and find where the values went non-finite "
        "(amped.monitor names the first GEMM, amped.doctor.diagnose the op), or pass "
        "allow_nonfinite=True to write it anyway. Nothing was written."
    )


def save_checkpoint(
    path: str | os.PathLike[str], *, allow_nonfinite: bool = False, **state: Any
) -> None:
    """Atomically write ``state`` (a dict of keyword arguments) to ``path`` with torch.save.

    Every floating tensor is checked first (one sync per device): a state holding an
    inf or NaN is refused, with the first bad tensor named, and nothing is written.

    Args:
        path: the checkpoint file; its directory must exist.
        allow_nonfinite: keyword-only. Write a state with inf/NaN values anyway.
        **state: what to save, e.g. ``model=model.state_dict(),
            scaler=scaler.state_dict(), step=step``.

    Raises:
        CheckpointError: a floating tensor holds an inf or NaN (unless
            ``allow_nonfinite``); the message names it (``state['model']['0.weight']``).
        OSError: the file could not be written (``ENOSPC`` for a full disk, ``EFBIG``
            for a file-size limit, ...); the previous checkpoint is left as it was.
    """
    target = os.fspath(path)
    if not allow_nonfinite:
        refuse_nonfinite(state, f"checkpoint {target!r}")
    directory = os.path.dirname(target) or "."
    prefix = f".{os.path.basename(target)}."
    remove_stale_temporaries(directory, prefix)
    handle, temporary = tempfile.mkstemp(
        prefix=f"{prefix}{os.getpid()}.", suffix=".tmp", dir=directory
    )
    try:
        _lock(handle, blocking=True)
        with os.fdopen(handle, "wb") as file:
            _save(state, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    fsync_directory(directory)


class _Writer:
    """A file for torch.save that remembers the OSError of a failed write: torch's
    writer replaces it by "unexpected pos", which hides a full disk."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.file.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        self.file.flush()


def _save(state: dict[str, Any], file: BinaryIO) -> None:
    writer = _Writer(file)
    try:
        torch.save(state, writer)  # type: ignore[arg-type]
    except Exception as error:
        if writer.error is not None:
            raise writer.error from error
        raise


def remove_stale_temporaries(directory: str, prefix: str) -> list[str]:
    """Remove ``prefix<pid>.<random>.tmp`` files in ``directory`` left by dead writers.

    A temporary is stale when no process holds its lock and its writer's process no
    longer exists (or, where a pid may have been reused, it is over an hour old). A
    live save, in this process or another, is never touched. Returns the names removed.
    Needs POSIX file locks; elsewhere it removes nothing.
    """
    if fcntl is None:  # pragma: no cover - and os.kill(pid, 0) would end a Windows process
        return []
    try:
        names = [n for n in os.listdir(directory) if n.startswith(prefix) and n.endswith(".tmp")]
    except OSError:
        return []
    removed = []
    for name in names:
        pid = name[len(prefix) :].split(".", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        path = os.path.join(directory, name)
        if _is_stale(path, int(pid)):
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed.append(name)
    return removed


def _is_stale(path: str, pid: int) -> bool:
    try:
        handle = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return False
    try:
        if not _lock(handle, blocking=False):
            return False  # a writer is at work on it
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            pass  # exists, owned by someone else
        return time.time() - os.fstat(handle).st_mtime > _REUSED_PID_AGE_S
    finally:
        os.close(handle)


def _lock(handle: int, *, blocking: bool) -> bool:
    """An exclusive advisory lock on an open file; released when the process dies."""
    if fcntl is None:  # pragma: no cover - not POSIX: nothing to lock with
        return True
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except OSError:
        return False
    return True


def load_checkpoint(path: str | os.PathLike[str], *, map_location: Any = None) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint` (or any ``torch.save`` of a dict).

    The whole file is checked first (layout, every CRC-32; one pass), then loaded with
    ``torch.load(weights_only=True)`` from the same open file, so what was checked is
    what is loaded even if the path is replaced meanwhile.

    Args:
        path: the checkpoint file.
        map_location: passed to ``torch.load``.

    Raises:
        CheckpointError: the file is torn, truncated, corrupt, not a ``torch.save``
            archive of a dict, or holds an object ``weights_only=True`` refuses (which
            never runs); the message says what was wrong. Nothing was loaded.
        FileNotFoundError, PermissionError: the file cannot be opened.
    """
    target = os.fspath(path)
    with open(target, "rb") as file:
        try:
            size = os.fstat(file.fileno()).st_size
            verify_archive(file, size)
            file.seek(0)
            state = torch.load(file, map_location=map_location, weights_only=True)
        except ArchiveError as error:
            raise CheckpointError(
                f"Checkpoint {target!r} is torn, truncated or corrupt: {error}. {_ADVICE}"
            ) from error
        except pickle.UnpicklingError as error:
            raise refused_object_error(target, error) from error
        except Exception as error:  # torch's reader or unpickler refused it
            raise CheckpointError(
                f"Checkpoint {target!r} could not be loaded ({type(error).__name__}: "
                f"{_first_line(error)}). {_ADVICE}"
            ) from error
    if not isinstance(state, dict):
        raise CheckpointError(
            f"Checkpoint {target!r} holds a {type(state).__name__}, not the dict that "
            "save_checkpoint writes."
        )
    return state


def refused_object_error(target: str, error: pickle.UnpicklingError) -> CheckpointError:
    """The :class:`CheckpointError` for a file holding an object that
    ``torch.load(weights_only=True)`` refused (``error``): nothing in it ran."""
    lines = [line.strip() for line in str(error).splitlines()]
    # torch's message opens with advice to turn weights_only off; its reason is
    # the line naming the global it refused (first line if torch words it otherwise).
    reason = next((line for line in lines if "global" in line.lower()), _first_line(error))
    return CheckpointError(
        f"Checkpoint {target!r} holds an object that torch.load(weights_only=True) "
        f"refuses to build (Weights only load failed: {reason}). Nothing in the file was "
        "run and nothing was loaded. amped's state is only tensors and plain data, so the "
        "file was altered or holds objects of your own: resume from a checkpoint you "
        "trust; for a file you trust whole, allow the object's type with "
        "torch.serialization.add_safe_globals."
    )


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0][:300] if lines else ""
