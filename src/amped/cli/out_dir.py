"""``--out`` and ``--seed``, checked before any training, and the report folder claimed.

Every way ``--out`` can fail (empty, a name too long, a parent the user cannot open, an
existing file, a folder that cannot be created or written) is a :class:`UsageError`
(one line, exit code 2) raised before the task is built. The folder is then claimed:
``.amped.lock`` in it is locked (``flock``, released by the kernel when the process
ends, however it ends) and holds the holder's pid, so a second run on the same
``--out`` is refused at once, naming that pid, instead of racing the first to write
``results.json`` and ``report.html`` from two different runs.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
from pathlib import Path

from amped._internal.files import check_writable
from amped.cli.errors import UsageError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no lock, as before
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_NAME", "MAX_SEED", "out_folder", "release_all", "resolve_out", "seed"]

LOCK_NAME = ".amped.lock"
MAX_SEED = 2**64 - 1
"""The largest seed ``torch.manual_seed`` takes (it takes no negative one we would want)."""
_NAME_MAX = 255  # bytes per path component on Linux, macOS and Windows file systems

_held: dict[Path, int] = {}  # folder -> open, locked lock file, for this process


def seed(text: str) -> int:
    """``--seed``: an integer in [0, 2**64 - 1], the range ``torch.manual_seed`` takes."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(
            f"expected an integer in [0, 2**64 - 1] (torch.manual_seed's range), got {text!r}"
        )
    return value


def out_folder(text: str) -> str:
    """``--out``: a non-empty path whose every name fits the file system (255 bytes)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            f"expected a folder name, got {text!r} (an empty --out would write into the "
            "current folder; pass --out . for that)"
        )
    for part in Path(text).parts:
        size = len(os.fsencode(part))
        if size > _NAME_MAX:
            raise argparse.ArgumentTypeError(
                f"a name in the path is {size} bytes long; file systems allow at most "
                f"{_NAME_MAX}: {part[:40]!r}..."
            )
    return text


def resolve_out(path: str) -> Path:
    """The report folder, created, test-written and claimed now, so that a bad, unwritable
    or busy ``--out`` fails before any training.

    Raises:
        UsageError: any of those, in one line that names ``--out``.
    """
    received = f"Received: --out {path!r}"
    out = Path(out_folder_or_usage(path))
    try:
        if out.exists() and not out.is_dir():
            raise UsageError(f"--out must be a folder, but {path!r} is a file. {received}")
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(
            f"Cannot create the report folder ({_reason(error)}). {received}"
        ) from None
    try:
        check_writable(out)
    except OSError as error:
        raise UsageError(
            f"Cannot write into the report folder ({_reason(error)}); choose a writable "
            f"--out. {received}"
        ) from None
    _claim(out, received)
    return out


def out_folder_or_usage(path: str) -> str:
    try:
        return out_folder(path)
    except argparse.ArgumentTypeError as error:
        raise UsageError(f"argument --out: {error}") from None


def _reason(error: OSError) -> str:
    if error.errno == errno.EACCES:
        return f"{error.strerror}: a folder on the path cannot be opened or written by you"
    if error.errno == errno.ENAMETOOLONG:
        return f"{error.strerror}: the path is longer than the file system allows"
    return str(error.strerror or error)


def _claim(out: Path, received: str) -> None:
    """Lock ``out``'s lock file for this process (a no-op if it holds it already)."""
    key = out.resolve()
    if fcntl is None or key in _held:
        return
    lock_path = out / LOCK_NAME
    try:
        handle = os.open(lock_path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o666)
    except OSError as error:
        raise UsageError(
            f"Cannot create the lock file {LOCK_NAME} in the report folder ({_reason(error)}). "
            f"{received}"
        ) from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(handle, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(handle)
        raise UsageError(
            f"Another amped run (pid {holder}) is writing into this report folder; wait "
            f"for it to finish or choose another --out. {received}"
        ) from None
    os.ftruncate(handle, 0)
    os.pwrite(handle, f"{os.getpid()}\n".encode("ascii"), 0)
    _held[key] = handle


def release_all() -> None:
    """Release the folders this process claimed (the CLI's end; process exit does it too)."""
    while _held:
        _, handle = _held.popitem()
        with contextlib.suppress(OSError):
            os.close(handle)
