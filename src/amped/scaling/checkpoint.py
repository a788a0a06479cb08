"""Checkpoints written atomically and read back only when whole.

:func:`save_checkpoint` writes with ``torch.save`` to a temporary file in the target's
directory, flushes it to disk and renames it over the target, so a crash (even
SIGKILL) leaves either the old file or the new one, never a mix. :func:`load_checkpoint`
checks the file before unpickling: ``torch.save`` writes a zip archive with a CRC-32
per member, but ``torch.load`` does not verify them (a flipped byte in tensor data
loads silently), so every member's CRC is checked first, then it loads with
``weights_only=True``. The files are plain torch checkpoints either way.

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
import tempfile
import zipfile
from typing import Any

import torch

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]


class CheckpointError(RuntimeError):
    """A checkpoint file is torn, truncated or corrupt; nothing was loaded from it."""


def save_checkpoint(path: str | os.PathLike[str], **state: Any) -> None:
    """Atomically write ``state`` (a dict of keyword arguments) to ``path`` with torch.save.

    Args:
        path: the checkpoint file; its directory must exist.
        **state: what to save, e.g. ``model=model.state_dict(),
            scaler=scaler.state_dict(), step=step``.
    """
    target = os.fspath(path)
    directory = os.path.dirname(target) or "."
    handle, temporary = tempfile.mkstemp(
        prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=directory
    )
    try:
        with os.fdopen(handle, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    _fsync_directory(directory)


def load_checkpoint(path: str | os.PathLike[str], *, map_location: Any = None) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint` (or any ``torch.save`` of a dict).

    Args:
        path: the checkpoint file.
        map_location: passed to ``torch.load``.

    Raises:
        CheckpointError: the file is torn, truncated or corrupt (checked before loading).
        FileNotFoundError: there is no such file.
    """
    target = os.fspath(path)
    advice = "Nothing was loaded; resume from an earlier checkpoint."
    try:
        with zipfile.ZipFile(target) as archive:
            bad_member = archive.testzip()
    except (zipfile.BadZipFile, EOFError) as error:
        raise CheckpointError(
            f"Checkpoint {target!r} is torn or truncated: it is not a complete torch.save "
            f"archive ({error or type(error).__name__}). {advice}"
        ) from error
    if bad_member is not None:
        raise CheckpointError(
            f"Checkpoint {target!r} is corrupt: member {bad_member!r} fails its CRC-32 "
            f"check. {advice}"
        )
    state = torch.load(target, map_location=map_location, weights_only=True)
    if not isinstance(state, dict):
        raise CheckpointError(
            f"Checkpoint {target!r} holds a {type(state).__name__}, not the dict that "
            "save_checkpoint writes."
        )
    return state


def _fsync_directory(directory: str) -> None:
    # Make the rename itself durable. Not every platform can open a directory.
    try:
        handle = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)
