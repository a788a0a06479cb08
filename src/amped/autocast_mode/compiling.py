"""What amped's engine needs from ``torch.compile`` (docs/engine.md, "torch.compile")."""

from __future__ import annotations

import contextvars
import types
from typing import Any

import torch

from amped._internal import torch_compat
from amped.autocast_mode.state import STATE

__all__ = [
    "COMPILE_SUPPORTED",
    "MIN_TORCH_FOR_COMPILE",
    "backward_autocast_off",
    "check_supported",
    "outside_regions",
    "restore_backward_autocast",
]

MIN_TORCH_FOR_COMPILE = (2, 13)
"""The oldest torch release on which compiling amped's engine is tested and allowed."""
COMPILE_SUPPORTED = torch_compat.torch_at_least(*MIN_TORCH_FOR_COMPILE)


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
# Set through its ContextVar, not the module's __setattr__ (ten times dearer). None
# before torch 2.13, which is refused anyway (check_supported): then nothing is set.
_entry = torch_compat.config_entry(_config, _NAME) if COMPILE_SUPPORTED else None


def backward_autocast_off() -> contextvars.Token[Any] | None:
    """Trace compiled backward passes with autocast off while the engine is active; the
    token undoes it (:func:`restore_backward_autocast`)."""
    if _entry is None:
        return None
    token = _entry.user_override.set("off")
    torch_compat.mark_config_changed(_config, _NAME)
    return token


def restore_backward_autocast(token: contextvars.Token[Any] | None) -> None:
    """Undo the :func:`backward_autocast_off` that returned ``token``."""
    if _entry is None or token is None:
        return
    try:
        _entry.user_override.reset(token)
    except ValueError:  # exited in another context (a task other than the entering one)
        old = token.old_value
        _entry.user_override.set(_entry.default if old is contextvars.Token.MISSING else old)
    torch_compat.mark_config_changed(_config, _NAME)


def never_root_frames(*modules: Any) -> None:
    """Keep Dynamo from compiling amped's own functions as frames of their own (after a
    graph break it cannot resume); traced functions still inline them (docs/engine.md).
    Called once, by the first region that may meet a compile."""
    skip_code = torch_compat.dynamo_skip_code()
    if skip_code is None:
        return
    for module in modules:
        filename = module.__file__
        values = list(vars(module).values())
        values += [attr for v in values if isinstance(v, type) for attr in vars(v).values()]
        for value in values:
            value = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
            # Only code written in that module: a decorator's wrapper (contextlib's,
            # functools') has its code elsewhere, shared with every other user.
            if isinstance(value, types.FunctionType) and value.__code__.co_filename == filename:
                skip_code(value.__code__)


_AUTOCAST_DTYPES = {
    "cpu": torch.bfloat16,
    "cuda": torch.float16,
    "mtia": torch.float16,
    "maia": torch.bfloat16,
    "xpu": torch.float16,
    "ipu": torch.float16,
    "hpu": torch.bfloat16,
    "xla": torch.bfloat16,
    "privateuseone": torch.float16,
    "mps": torch.float16,
}
"""Every device type whose autocast state Dynamo's global-state guard reads, with
torch's default autocast dtype for it: the state :func:`outside_regions` calls under."""


_Undo = list[tuple[str | None, bool, torch.dtype | None]]
_seen: tuple[Any, Any, _Undo] | None = None
"""(the global state outside_regions last called under, after its changes; the last
other state it found; what it changed in that one): a state that checks against either
is handled without reading each device type's (about 0.2 us a check, 20 reads saved)."""


def outside_regions(function: Any, *args: Any) -> Any:
    """``function(*args)`` under ``no_grad``, on this thread, as if no autocast region were
    open: autocast off (at torch's default dtypes and cache setting) on every device
    type, so that a compiled ``function`` computes and is guarded the same wherever it is
    called, and a compile it starts leaves this thread's amped regions on their paths
    (amped's compiled casts, called inside the layers' regions)."""
    st = STATE
    grad = torch.is_grad_enabled()
    torch_compat.set_grad_enabled(False)
    changed = _to_neutral()
    aside, st.aside = st.aside, True
    try:
        return function(*args)
    finally:
        st.aside = aside
        for device_type, enabled, dtype in changed:
            if device_type is None:
                torch.set_autocast_cache_enabled(False)
            else:
                torch.set_autocast_enabled(device_type, enabled)
                torch.set_autocast_dtype(device_type, dtype)
        torch_compat.set_grad_enabled(grad)


def _to_neutral() -> _Undo:
    # Turn autocast off everywhere (torch's default dtypes, cache on); return what to undo.
    global _seen
    seen = _seen  # (read once: another thread may replace it)
    if seen is not None and seen[0].check():
        return []
    if seen is not None and seen[1].check():
        changed = seen[2]
        for device_type, _, _ in changed:
            if device_type is None:
                torch.set_autocast_cache_enabled(True)
            else:
                torch.set_autocast_enabled(device_type, False)
                torch.set_autocast_dtype(device_type, _AUTOCAST_DTYPES[device_type])
        return changed
    found = torch_compat.dynamo_global_state()
    changed: _Undo = []
    for device_type, dtype in _AUTOCAST_DTYPES.items():
        enabled = torch.is_autocast_enabled(device_type)
        was = torch.get_autocast_dtype(device_type)
        if enabled or was is not dtype:
            changed.append((device_type, enabled, was))
            torch.set_autocast_enabled(device_type, False)
            torch.set_autocast_dtype(device_type, dtype)
    if not torch.is_autocast_cache_enabled():
        changed.append((None, False, None))
        torch.set_autocast_cache_enabled(True)
    _seen = (torch_compat.dynamo_global_state(), found, changed)
    return changed
