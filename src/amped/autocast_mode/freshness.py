"""Keeping torch's weight cache fresh while the fast path runs.

On the fast path torch's C++ autocast casts every op whose rule is torch's, with its own
weight cache, which serves a stale copy of a weight changed in place inside the region
(an optimizer step, ``copy_`` under ``no_grad``). amped's rule is to cast such a weight
again. So while a fast-path region is open anywhere, a global module forward pre-hook
compares the version counters of the called module's own parameters with those it saw
last in this region; when one moved, it drops this thread's autocast cache (torch's
``clear_autocast_cache``), and the next op casts afresh. Unchanged weights keep their
cached cast, exactly as under torch.

It covers weights held by ``nn.Module`` s and changed between module calls, which is
where training code changes them; a bare tensor changed in place and used again in the
same region without a module call in between is served as torch serves it.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.nn.modules import module as nn_module

__all__ = ["acquire", "check", "forget", "release"]


class _Seen(threading.local):
    def __init__(self) -> None:
        self.active = False  # a fast-path region is open on this thread
        self.versions: dict[int, tuple[torch.Tensor, int]] = {}


_seen = _Seen()
_lock = threading.Lock()
_users = 0
_handle: Any = None
_clear = torch.clear_autocast_cache


def _pre_hook(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
    if _seen.active:
        check(module)


def check(module: torch.nn.Module) -> None:
    """Drop this thread's autocast cache if a parameter of ``module`` changed in place
    since this region last saw it (the module rules' hook calls it too)."""
    seen = _seen
    versions = seen.versions
    stale = False
    for p in module._parameters.values():
        if p is None:
            continue
        entry = versions.get(id(p))
        if entry is None or entry[0] is not p:
            versions[id(p)] = (p, p._version)
        elif entry[1] != p._version:
            versions[id(p)] = (p, p._version)
            stale = True
    if stale:
        _clear()


def set_active(active: bool) -> None:
    """Whether this thread has a fast-path region open (the hook acts only then)."""
    _seen.active = active


def forget() -> None:
    """Drop this thread's recorded versions (its outermost region closed)."""
    _seen.versions.clear()


def acquire() -> None:
    """A fast-path region opened: install the hook if it is not installed."""
    global _users, _handle
    with _lock:
        _users += 1
        if _handle is None:
            _handle = nn_module.register_module_forward_pre_hook(_pre_hook)


def release() -> None:
    """A fast-path region closed: remove the hook when none is left open."""
    global _users, _handle
    with _lock:
        _users -= 1
        if _users == 0 and _handle is not None:
            _handle.remove()
            _handle = None
