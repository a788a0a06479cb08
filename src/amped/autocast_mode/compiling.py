"""What amped's engine needs from ``torch.compile``, and which torch releases give it.

Graphs compiled while the engine is on the stack trace their backward with autocast off,
as eager autograd runs it; why, and the traced stand-ins for the engine's eager
mechanisms, are in docs/engine.md ("torch.compile").
"""

from __future__ import annotations

import contextvars
import threading
from typing import Any

import torch

from amped._internal import torch_compat

__all__ = [
    "COMPILE_SUPPORTED",
    "MIN_TORCH_FOR_COMPILE",
    "backward_autocast_off",
    "check_supported",
    "restore_backward_autocast",
]

MIN_TORCH_FOR_COMPILE = (2, 13)
"""The oldest torch release on which compiling amped's engine is tested and allowed."""


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


COMPILE_SUPPORTED = _release(torch.__version__) >= MIN_TORCH_FOR_COMPILE


def check_supported() -> None:
    """Raise if Dynamo is tracing amped's engine on a torch release that cannot."""
    if not COMPILE_SUPPORTED:
        raise RuntimeError(
            "torch.compile of code running amped's engine (a policy other than torch's "
            "own, a module rule, 'strict', a custom op, the doctor) needs torch >= "
            f"{MIN_TORCH_FOR_COMPILE[0]}.{MIN_TORCH_FOR_COMPILE[1]}. Upgrade torch, "
            "or keep the default policy (torch's C++ autocast compiles on every release), "
            "or leave this code uncompiled. Received: torch " + torch.__version__
        )


_NAME = "backward_pass_autocast"
_config = torch_compat.FUNCTORCH_CONFIG
_entry = torch_compat.config_entry(_config, _NAME)
_fast = _entry is not None  # set through its ContextVar, not the module's __setattr__


class _Saved(threading.local):
    def __init__(self) -> None:
        self.stack: list[tuple[object, object]] = []  # (token or None, previous value)


_saved_per_thread = _Saved()


def backward_autocast_off() -> None:
    """Trace compiled backward passes with autocast off while the engine is active."""
    if _fast:
        override = _entry.user_override
        _saved_per_thread.stack.append((override.set("off"), override))
        torch_compat.mark_config_changed(_config, _NAME)
        return
    if _config is None or not hasattr(_config, _NAME):
        _saved_per_thread.stack.append((None, None))
        return
    _saved_per_thread.stack.append((None, getattr(_config, _NAME)))
    setattr(_config, _NAME, "off")


def restore_backward_autocast() -> None:
    """Undo the matching :func:`backward_autocast_off`."""
    saved = _saved_per_thread.stack
    if not saved:
        return
    token, previous = saved.pop()
    if previous is None:
        return
    if isinstance(token, contextvars.Token):
        try:
            _entry.user_override.reset(token)
        except ValueError:  # exited in another context (a task other than the entering one)
            old = token.old_value
            if old is contextvars.Token.MISSING:
                old = _entry.default
            _entry.user_override.set(old)
        torch_compat.mark_config_changed(_config, _NAME)
        return
    setattr(_config, _NAME, previous)


def never_root_frames(*modules: object) -> None:
    """Keep Dynamo from compiling amped's own functions as frames of their own (after a
    graph break it cannot resume); traced functions still inline them (docs/engine.md).
    Called once, by the first region that may meet a compile."""
    skip_code = torch_compat.dynamo_skip_code()
    if skip_code is None:
        return
    for module in modules:
        filename = getattr(module, "__file__", None)
        for value in list(vars(module).values()):
            for fn in _functions_in(value, getattr(module, "__name__", "")):
                # Only code written in that module: a decorator's wrapper (contextlib's,
                # functools') has its code elsewhere, shared with every other user.
                if fn.__code__.co_filename == filename:
                    skip_code(fn.__code__)


def _functions_in(value: object, module_name: str) -> list[Any]:
    import types

    if isinstance(value, types.FunctionType):
        return [value] if value.__module__ == module_name else []
    if isinstance(value, type) and value.__module__ == module_name:
        found: list[Any] = []
        for attr in vars(value).values():
            attr = getattr(attr, "__func__", attr)  # classmethod / staticmethod
            if isinstance(attr, types.FunctionType):
                found.append(attr)
            elif isinstance(attr, property) and attr.fget is not None:
                found.append(attr.fget)
        return found
    return []
