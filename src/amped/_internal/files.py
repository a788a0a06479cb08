"""Atomic, symlink-safe file writes; errors surface as the OSError they are.

:func:`write_files` writes a set of files that belong together (``results.json`` and
``report.html``; ``doctor.json`` and ``doctor.html``):

1. Each file's content goes to a fresh temporary in the target folder, created with
   ``O_CREAT | O_EXCL`` under an unpredictable name (so nothing planted at that name,
   a symlink included, is followed or overwritten), and is flushed to disk.
2. Only when every temporary is complete do the targets change, with the signals that
   interrupt the CLI (SIGINT, SIGTERM) held back: the old files of the set are removed
   first (the later ones first), then each temporary is renamed over its target.
   ``rename`` replaces a symlink at the target itself and never writes through it.

So at every instant the folder holds either the old set, a prefix of the new set, or
the whole new set; never a torn file and never a new file beside an old partner. A
write error (a full disk, a file-size limit, a read-only folder) leaves the old set as
it was and removes the temporaries; it is raised as the ``OSError`` it is.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = ["check_writable", "fsync_directory", "write_files"]

_HELD = {signal.SIGINT, signal.SIGTERM}


def write_files(files: Sequence[tuple[Path, str | bytes]]) -> list[Path]:
    """Write ``(path, content)`` pairs as one set (see the module docstring).

    ``str`` content is written as UTF-8. Each file gets the mode a plain ``open`` would
    give it (0666 less the umask). Returns the paths, in order.

    Raises:
        OSError: a file could not be written; the previous files are unchanged.
    """
    temporaries: list[tuple[str, Path]] = []
    try:
        for path, content in files:
            data = content.encode("utf-8") if isinstance(content, str) else content
            temporaries.append((_write_temporary(path, data), path))
        with _signals_held():
            for _, path in reversed(temporaries[1:]):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            for temporary, path in temporaries:
                os.replace(temporary, path)
    except BaseException:
        for temporary, _ in temporaries:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
        raise
    for folder in {path.parent for path in (p for p, _ in files)}:
        fsync_directory(folder)
    return [path for path, _ in files]


def check_writable(folder: Path) -> None:
    """Create and remove a temporary file in ``folder``; raises the OSError if it cannot.

    A permission check by mode bits would be wrong for root, on read-only mounts and
    under ACLs, so this tries what the report writer will do.
    """
    handle, name = tempfile.mkstemp(prefix=".amped-probe.", suffix=".tmp", dir=folder)
    os.close(handle)
    os.unlink(name)


def _write_temporary(path: Path, data: bytes) -> str:
    handle, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as file:
            if hasattr(os, "fchmod"):  # mkstemp makes 0600; a report is as open() makes it
                os.fchmod(file.fileno(), 0o666 & ~_umask())
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name)
        raise
    return name


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Delay SIGINT and SIGTERM over a few renames (they are delivered afterwards)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(
        signal, "pthread_sigmask"
    ):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """Make a rename in ``directory`` durable (where the platform can open a directory)."""
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
