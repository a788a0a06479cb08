"""The user's source line: the innermost frame outside torch and amped.

amped's reports point at the line of the user's code that led to an op or a layer's
call (``amped.doctor``'s culprits, ``amped.monitor``'s first non-finite). Two ways to
find it: :func:`user_source` from a recorded ``traceback`` stack, and
:func:`user_frame` from the live frames, cheap enough to call on every layer's forward
(it walks frame objects and reads no source text; :func:`describe` reads the line
only when a report needs it).
"""

from __future__ import annotations

import inspect
import linecache
import os
import traceback

import torch

__all__ = ["OWN_DIRS", "describe", "user_frame", "user_source"]

OWN_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
"""Frames from files under these folders (torch, amped) are not the user's."""


def describe(filename: str, lineno: int, name: str, line: str | None = None) -> str:
    """``path:line (code)``: the path relative to the working folder where it is below
    it, and the source text of the line (or the function's name if there is none)."""
    path = os.path.relpath(filename)
    path = filename if path.startswith("..") else path
    if line is None:
        line = linecache.getline(filename, lineno).strip()
    return f"{path}:{lineno} ({line or name})"


def user_source(stack: traceback.StackSummary | None) -> str | None:
    """The innermost frame of ``stack`` outside torch and amped, described; None if all
    of it is theirs."""
    for frame in reversed(stack or []):
        if not frame.filename.startswith(OWN_DIRS):
            return describe(frame.filename, frame.lineno or 0, frame.name, frame.line or "")
    return None


def user_frame() -> tuple[str, int, str] | None:
    """(file, line, function) of the innermost live frame outside torch and amped (the
    caller's callers included); None if there is none. Reads no source text."""
    frame = inspect.currentframe()
    while frame is not None:
        code = frame.f_code
        if not code.co_filename.startswith(OWN_DIRS):
            return code.co_filename, frame.f_lineno, code.co_name
        frame = frame.f_back
    return None
