"""The one rule for a module run in float32 under autocast.

A policy's ``"fp32"`` module rule (:mod:`.module_hooks`, global module hooks) and the
O2 recipes' norm layers (:func:`run_in_float32`, hooks on those modules alone) both run
a module as ``torch.amp.custom_fwd(cast_inputs=torch.float32)`` runs a function: where
autocast is on for the module's device type, its floating inputs (not float64),
positional and keyword, nested in tuples, lists and dicts too, are cast to float32,
and autocast is off for the module's call, then as it was. Where autocast is off (a
nested ``autocast(enabled=False)``, a ``"skip"`` rule around), nothing is cast.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from amped._internal.trees import map_tensors

__all__ = ["autocast_off", "cast_on", "float32_inputs", "restore_autocast", "run_in_float32"]


def autocast_off(device_types: Iterable[str]) -> dict[str, bool]:
    """Turn autocast off for each of ``device_types``; returns whether each was on (for
    :func:`restore_autocast`, and :func:`cast_on` the ones to cast inputs for)."""
    enabled = {dev: torch.is_autocast_enabled(dev) for dev in device_types}
    for dev in enabled:
        torch.set_autocast_enabled(dev, False)
    return enabled


def restore_autocast(enabled: dict[str, bool]) -> None:
    """Undo :func:`autocast_off`."""
    for dev, was_enabled in enabled.items():
        torch.set_autocast_enabled(dev, was_enabled)


def cast_on(enabled: dict[str, bool]) -> list[str]:
    """The device types whose inputs a float32 module gets cast: those autocast was on for."""
    return [dev for dev, on in enabled.items() if on]


def float32_inputs(inputs: Any, device_types: list[str]) -> Any:
    """``inputs`` with each floating tensor (float64 aside) on one of ``device_types`` cast
    to float32, in lists, tuples and dicts too: what
    ``torch.amp.custom_fwd(cast_inputs=torch.float32)`` does to a function's arguments,
    positional and keyword."""
    if not device_types:
        return inputs

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        floating = tensor.is_floating_point() and tensor.dtype is not torch.float64
        return tensor.float() if floating and tensor.device.type in device_types else tensor

    return map_tensors(cast, inputs)


class _Calls(threading.local):
    """Per thread: for each open hooked call, innermost last, the autocast state it left."""

    def __init__(self) -> None:
        self.enabled: list[dict[str, bool]] = []


def run_in_float32(modules: Iterable[torch.nn.Module], device_type: str) -> list[RemovableHandle]:
    """Hook ``modules`` to run in float32 under autocast on ``device_type`` (see the module
    docstring), without a policy rule: the region then needs no module hooks of its own,
    so it can run torch's C++ autocast. Returns the hooks' handles; removing them undoes
    it."""
    calls = _Calls()
    device_types = [device_type]

    def before(
        module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, Any] | None:
        enabled = autocast_off(device_types)
        calls.enabled.append(enabled)
        on = cast_on(enabled)
        return float32_inputs((args, kwargs), on) if on else None

    def after(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        restore_autocast(calls.enabled.pop())

    handles = []
    for module in modules:
        handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(module.register_forward_hook(after, always_call=True))
    return handles
