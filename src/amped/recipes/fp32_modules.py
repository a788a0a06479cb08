"""Modules that run in float32 under autocast, by forward hooks of their own (O2's norms).

O2 keeps the model's norm layers in float32 (weights and computation). Through a module
rule of the autocast policy that costs the forward pass Python on every module call
and every op inside a norm (amped's engine, see :mod:`amped.autocast_mode.module_hooks`).
Here the recipe hooks those modules alone, with the engine's rule for a module run in
float32 (:func:`amped.autocast_mode.module_hooks.float32_inputs`, the semantics of
``torch.amp.custom_fwd(cast_inputs=torch.float32)``): where autocast is on for the
module's device type, its floating inputs, positional and keyword (not float64; nested
in lists, tuples and dicts too) are cast to float32 and autocast is off for the
module's call, then back on. Elsewhere the module runs as it is. The region itself then
needs no rule, so it runs torch's own C++ autocast.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from amped.autocast_mode.module_hooks import float32_inputs

__all__ = ["run_in_float32"]


class _Calls(threading.local):
    """Per thread: for each open hooked call, innermost last, whether it turned autocast off."""

    def __init__(self) -> None:
        self.turned_off: list[bool] = []


def run_in_float32(modules: Iterable[torch.nn.Module], device_type: str) -> list[RemovableHandle]:
    """Hook ``modules`` to run in float32 under autocast on ``device_type`` (see the module
    docstring). Returns the hooks' handles; removing them undoes it."""
    calls = _Calls()
    device_types = [device_type]

    def before(
        module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, Any] | None:
        if not torch.is_autocast_enabled(device_type):
            calls.turned_off.append(False)
            return None
        calls.turned_off.append(True)
        torch.set_autocast_enabled(device_type, False)
        return float32_inputs((args, kwargs), device_types)

    def after(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if calls.turned_off.pop():
            torch.set_autocast_enabled(device_type, True)

    handles = []
    for module in modules:
        handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(module.register_forward_hook(after, always_call=True))
    return handles
