"""Everything amped's engine does about ``torch.compile``, in one place (docs/engine.md,
"torch.compile"). The engine's other modules ask here, through this interface:

- :func:`tracing` (whether Dynamo is tracing the calling code: the branch each module
  takes where traced code must differ) and :func:`check_supported` (the torch release);
- :data:`outside_graph` (run a function eagerly, outside the graph) and
  :data:`once_while_tracing` (run it for real while tracing, its result folded in);
- :func:`without_torch_autocast_traced`: the traced form of the exclude guard;
- :func:`listen`: hear each compile start on its thread, and Dynamo's resets;
- :func:`traced`: the policies a compile on this thread traced (per thread: a compile
  changes no other thread's paths), and :func:`mark_for_guards`, the autocast flag
  Dynamo's guards read for a region;
- :func:`backward_autocast_off` / :func:`restore_backward_autocast`, and
  :func:`never_root_frames`;
- :func:`outside_regions`: amped's own compiled helpers, called inside regions.
"""

from __future__ import annotations

import contextvars
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from amped._internal import torch_compat
from amped.autocast_mode.state import STATE, EngineState
from amped.policy import Policy

__all__ = [
    "COMPILE_SUPPORTED",
    "GUARD_DEVICE_TYPE",
    "MIN_TORCH_FOR_COMPILE",
    "backward_autocast_off",
    "check_supported",
    "listen",
    "listening",
    "mark_for_guards",
    "never_root_frames",
    "once_while_tracing",
    "outside_graph",
    "outside_regions",
    "restore_backward_autocast",
    "traced",
    "tracing",
    "tracing_flag",
    "without_torch_autocast_traced",
]

MIN_TORCH_FOR_COMPILE = (2, 13)
"""The oldest torch release on which compiling amped's engine is tested and allowed."""
COMPILE_SUPPORTED = torch_compat.torch_at_least(*MIN_TORCH_FOR_COMPILE)

tracing = torch.compiler.is_dynamo_compiling
"""Whether Dynamo is tracing the calling code: Dynamo folds it to True while tracing;
eagerly it costs one frame (``torch.compiler.is_compiling()`` costs two)."""
tracing_flag = torch_compat.dynamo_is_compiling_flag
""":func:`tracing` read from torch's module flag: no Python frame of torch's (the fast
path's kernels, which run at the dispatcher, read it per call)."""
outside_graph = torch_compat.dynamo_disable
"""Decorator: Dynamo runs the function eagerly, outside the graph (a graph break)."""
once_while_tracing = torch_compat.assume_constant_result
"""Decorator: Dynamo calls the function for real once while tracing and folds its result
into the graph, unguarded (the graph must not depend on whether it ran before)."""


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


def without_torch_autocast_traced(
    device_types: tuple[str, ...], func: Callable[..., Any], args: Any, kwargs: Any
) -> Any:
    """``func(*args, **kwargs)`` with torch's C++ autocast off for ``device_types``, as
    Dynamo can trace it: ``torch.autocast(enabled=False)`` for each (eagerly an exclude
    guard does it, which Dynamo cannot trace; for one op call both mean "no autocast
    kernel runs")."""
    check_supported()
    if not device_types:
        return func(*args, **kwargs)
    with torch.autocast(device_types[0], enabled=False):
        return without_torch_autocast_traced(device_types[1:], func, args, kwargs)


# Hearing compile starts. Dynamo's callbacks are process-wide and run on the compiling
# thread; what the engine does then concerns that thread's regions alone.

_on_start: Callable[[], None] | None = None  # the engine's, once it listens
_resets = 0
"""How many ``torch._dynamo.reset()`` amped has seen: a reset drops every graph, and with
them every thread's traced policies (:func:`traced`)."""


def _started(args: Any) -> None:
    if _on_start is not None and not STATE.aside:  # (aside: outside_regions)
        _on_start()


def listening() -> bool:
    """Whether amped hears compile starts (``torch._dynamo.reset()`` drops its callback)."""
    return _started in torch_compat.dynamo_callbacks.start_callbacks


def listen(on_start: Callable[[], None]) -> bool:
    """Call ``on_start()`` on the compiling thread whenever Dynamo starts a compile (but
    one of :func:`outside_regions`). Called again at each region that may meet a compile:
    returns whether Dynamo was reset since it last listened (every graph dropped, and
    every thread's traced policies with them). The first call keeps Dynamo from making
    any of the engine's functions a root frame (:func:`never_root_frames`)."""
    global _on_start, _resets
    if listening():
        return False
    torch_compat.dynamo_callbacks.register_start_callback(_started)
    reset = _on_start is not None
    if reset:
        _resets += 1
    else:  # the first region that may meet a compile: nothing happens at import
        never_root_frames(*[m for n, m in sys.modules.items() if n.startswith(__package__)])
    _on_start = on_start
    return reset


def traced(st: EngineState) -> set[Policy]:
    """The policies a compile on ``st``'s thread traced since Dynamo's last reset: later
    regions of these on that thread take ``MODE``, to pass the graphs' guards. Kept per
    thread, so that a compile on one thread changes no other thread's paths."""
    if st.traced_since != _resets:
        st.traced.clear()
        st.traced_since = _resets
    return st.traced


GUARD_DEVICE_TYPE = "ipu"
"""The device type whose autocast flag marks, for Dynamo's guards, that a region of a
policy other than torch's own (or with module rules) is open: a graph traced without the
mark never runs inside such a region (docs/engine.md). No tensor lives on it."""


def mark_for_guards(st: EngineState, on: bool) -> None:
    """Set the mark of :data:`GUARD_DEVICE_TYPE` (eagerly; a graph holds what it found)."""
    if on is not st.guard_mark and not tracing():
        torch.set_autocast_enabled(GUARD_DEVICE_TYPE, on)
        st.guard_mark = on


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


_Undo = tuple[list[tuple[str, bool, torch.dtype]], bool]
"""What :func:`outside_regions` changed: (device type, autocast enabled, dtype) as found,
for each device type it changed; whether it turned the autocast cache on."""
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
    devices, cache_off = _to_neutral()
    aside, st.aside = st.aside, True
    try:
        return function(*args)
    finally:
        st.aside = aside
        for device_type, enabled, dtype in devices:
            torch.set_autocast_enabled(device_type, enabled)
            torch.set_autocast_dtype(device_type, dtype)
        if cache_off:
            torch.set_autocast_cache_enabled(False)
        torch_compat.set_grad_enabled(grad)


def _to_neutral() -> _Undo:
    # Turn autocast off everywhere (torch's default dtypes, cache on); return what to undo.
    global _seen
    seen = _seen  # (read once: another thread may replace it)
    if seen is not None and seen[0].check():
        return [], False
    if seen is not None and seen[1].check():
        devices, cache_off = seen[2]
        for device_type, _, _ in devices:
            torch.set_autocast_enabled(device_type, False)
            torch.set_autocast_dtype(device_type, _AUTOCAST_DTYPES[device_type])
        if cache_off:
            torch.set_autocast_cache_enabled(True)
        return seen[2]
    found = torch_compat.dynamo_global_state()
    changed = []
    for device_type, dtype in _AUTOCAST_DTYPES.items():
        enabled = torch.is_autocast_enabled(device_type)
        was = torch.get_autocast_dtype(device_type)
        if enabled or was is not dtype:
            changed.append((device_type, enabled, was))
            torch.set_autocast_enabled(device_type, False)
            torch.set_autocast_dtype(device_type, dtype)
    cache_off = not torch.is_autocast_cache_enabled()
    if cache_off:
        torch.set_autocast_cache_enabled(True)
    _seen = (torch_compat.dynamo_global_state(), found, (changed, cache_off))
    return changed, cache_off
