"""The module rules' global hooks: a region whose policy has module rules switches the
mode engine to fp32 / low precision (or autocast off) inside matching modules.

Installed while any such region is open (:class:`_GlobalHooks`), and for good, idle,
once torch.compile may have traced them (``dispatch.compiled_once``, or a region opened
inside a compiled function); they read the thread state of
:mod:`amped.autocast_mode.state`.
"""

from __future__ import annotations

import threading
from typing import Any, cast

import torch
from torch.nn.modules import module as nn_module

from amped._internal import torch_compat
from amped.autocast_mode import dispatch, freshness, state
from amped.policy import ModuleRule, Policy

__all__ = ["hooks"]


def _match(module: torch.nn.Module, policies: dict[str, Policy]) -> ModuleRule | None:
    name = state._state.names.get(id(module))
    for policy in policies.values():
        for rule in reversed(policy.module_rules):  # later rules take precedence
            if rule.matches(module, name):
                return rule
    return None


def _pre_hook(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    st = state._state
    mode = st.mode
    if mode is None or not mode.module_rules:  # idle (hooks outlive compiled regions)
        return None
    lean = mode.lean and not _is_compiling()  # (traced: no cache, no mode below)
    if lean:  # torch's cache serves torch's own rules: keep it fresh
        if mode.on_stack:
            with _no_torch_function():  # (each p._version would reach the mode: 0.8 us)
                freshness.check(module)
        else:
            freshness.check(module)
    if mode.named_rules:
        if not st.frames:  # the outermost module call: name its submodules
            st.names = {id(m): name for name, m in module.named_modules()}
        rule = _match(module, mode.policies)
        if rule is None:
            st.frames.append((module, None))  # (the next call is not the outermost)
            return None
    elif _is_compiling():  # traced: no cache to fill (Dynamo would guard on its size)
        rule = _match(module, mode.policies)
        if rule is None:
            return None
    else:  # rules by type alone: one look-up per module class
        by_type = mode.rule_by_type
        rule = by_type.get(type(module), _UNSEEN)
        if rule is _UNSEEN:
            rule = by_type[type(module)] = _match(module, mode.policies)
        if rule is None:
            return None
    enabled = {dev: torch.is_autocast_enabled(dev) for dev in mode.policies}
    if rule.precision == "skip":
        st.frames.append((module, (mode.override, enabled, False)))
        for dev in mode.policies:
            torch.set_autocast_enabled(dev, False)
        return None
    pushed = not mode.on_stack  # a parked mode: on the stack for this module's call
    if pushed:
        state.stack(mode)
        mode.held = True
    st.frames.append((module, (mode.override, enabled, pushed)))
    mode.set_override(rule.precision)
    if rule.precision == "fp32":
        if lean:  # no mode below to show the casts to; Tensor.float() is not autocast
            with _no_torch_function():
                return tuple(_to_float32(a, mode.policies) for a in args)
        return tuple(_to_float32(a, mode.policies) for a in args)
    return None


_no_torch_function = torch_compat.DisableTorchFunction
_is_compiling = torch.compiler.is_dynamo_compiling
_UNSEEN: Any = object()


def _to_float32(value: Any, device_types: dict[str, Policy]) -> Any:
    # Where autocast is off for the device type (a nested autocast(enabled=False), a
    # "skip" rule around), a module rule applies nothing, as an op rule does not (and as
    # torch's custom_fwd(cast_inputs=...)): a graph compiled outside any region, whose
    # guards pass there, computes the same.
    if (
        isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and value.dtype is not torch.float64
        and value.device.type in device_types
        and torch.is_autocast_enabled(value.device.type)
    ):
        return value.float()
    return value


def _post_hook(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
    st = state._state
    if not st.frames or st.frames[-1][0] is not module:
        return
    _, saved = st.frames.pop()
    mode = st.mode
    if saved is not None and mode is not None:
        override, enabled, pushed = saved
        mode.set_override(override)
        for dev, was_enabled in enabled.items():
            torch.set_autocast_enabled(dev, was_enabled)
        if pushed and mode.held:
            mode.held = False
            if mode.parkable:
                state.unstack(mode)


class _GlobalHooks:
    """Module hooks, installed while any region whose policy has module rules is open."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._handles: list[Any] = []
        self.traced = False  # installed while Dynamo traced: some graph holds them

    def acquire(self) -> None:
        if torch.compiler.is_compiling():
            # Dynamo traces one thread and cannot enter a lock nor register hooks in a
            # graph; it runs the installation for real while tracing (the hooks are
            # then traced into every module call after it) and counts.
            _install_while_tracing()
            self._users += 1
            return
        with self._lock:
            self._users += 1
            self.install()

    def install(self) -> None:
        """Install the hooks if they are not installed (idle unless a region needs them)."""
        if not self._handles:
            self._handles = [
                # torch annotates the hook as returning None; returning new args is
                # documented and supported.
                nn_module.register_module_forward_pre_hook(cast(Any, _pre_hook)),
                nn_module.register_module_forward_hook(_post_hook, always_call=True),
            ]

    def release(self) -> None:
        if torch.compiler.is_compiling():
            # The hooks stay installed (idle, they return at once) until an eager
            # release finds no user left: a graph cannot remove them.
            self._users -= 1
            return
        with self._lock:
            self._users -= 1
            # Once a graph may have traced them, they stay (idle): Dynamo guards on the
            # global hook dicts, and new hooks at each region would recompile each step.
            if self._users == 0 and not (dispatch.compiled_once or self.traced):
                for handle in self._handles:
                    handle.remove()
                self._handles = []


hooks = _GlobalHooks()


@torch_compat.assume_constant_result
def _install_while_tracing() -> bool:
    with hooks._lock:
        hooks.install()
        hooks.traced = True
    return True
