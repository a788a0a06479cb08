"""Module rules as global module hooks, installed while a region whose policy has some is
open (docs/engine.md, "Module rules are module hooks"). ``"fp32"`` and ``"skip"`` run as
``torch.amp.custom_fwd`` runs a function; ``"low"`` sets the mode's low flag.

:func:`float32_inputs` is the one rule for a module run in float32, which the O2
recipes' own norm hooks (:mod:`amped.recipes.fp32_modules`) apply too.
"""

from __future__ import annotations

import threading
from typing import Any, cast

import torch
from torch.nn.modules import module as nn_module

from amped._internal.trees import map_tensors
from amped.autocast_mode import compiling
from amped.autocast_mode.state import STATE, kept
from amped.policy import ModuleRule, Policy

__all__ = ["float32_inputs", "hooks"]

_is_compiling = compiling.tracing


def _match(module: torch.nn.Module, policies: dict[str, Policy]) -> ModuleRule | None:
    name = STATE.names.get(id(module))
    for policy in policies.values():
        for rule in reversed(policy.module_rules):  # later rules take precedence
            if rule.matches(module, name):
                return rule
    return None


def _named(policies: dict[str, Policy]) -> bool:
    # Whether some rule selects modules by qualified name: the hooks must name modules.
    # (Loops: Dynamo traces them, not generator expressions.)
    for policy in policies.values():
        for rule in policy.module_rules:
            if isinstance(rule.selector, str):
                return True
    return False


def _rule_for(module: torch.nn.Module, policies: dict[str, Policy]) -> ModuleRule | None:
    if len(policies) == 1 and not _is_compiling():  # (traced: no cache, Dynamo guards its size)
        (policy,) = policies.values()
        empty = dict[type, ModuleRule | None]
        by_type = kept(policy, "rule by type", lambda: None if _named(policies) else empty())
        if by_type is not None:  # rules by type alone: one look-up per class
            if type(module) not in by_type:
                by_type[type(module)] = _match(module, policies)
            return by_type[type(module)]
    if not _named(policies):
        return _match(module, policies)
    if not STATE.frames:  # the outermost module call: name its submodules
        STATE.names = {id(m): name for name, m in module.named_modules()}
    rule = _match(module, policies)
    if rule is None:
        STATE.frames.append((module, None))  # (the next call is not the outermost)
    return rule


def _pre_hook(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    policies = STATE.ruled
    if not policies:  # idle (no module-rule region open, or hooks outliving a graph)
        return None
    rule = _rule_for(module, policies)
    if rule is None:
        return None
    enabled = {dev: torch.is_autocast_enabled(dev) for dev in policies}
    if rule.precision == "low":  # (its region runs the mode: engine._choose_path)
        STATE.frames.append((module, ("low", enabled, STATE.mode.low)))
        STATE.mode.low = True
        return None
    STATE.frames.append((module, (rule.precision, enabled, None)))
    if rule.precision == "fp32":
        args = float32_inputs(args, [dev for dev, on in enabled.items() if on])
    for dev in policies:
        torch.set_autocast_enabled(dev, False)
    return args if rule.precision == "fp32" else None


def float32_inputs(inputs: Any, device_types: list[str]) -> Any:
    """``inputs`` with each floating tensor (float64 aside) on one of ``device_types`` cast
    to float32, in lists, tuples and dicts too: what
    ``torch.amp.custom_fwd(cast_inputs=torch.float32)`` does to a function's arguments.
    ``device_types``: those where autocast is on (where it is off, a nested
    ``autocast(enabled=False)`` or a ``"skip"`` rule around, nothing is cast, as under
    ``custom_fwd``); the module then runs with autocast off for them."""
    if not device_types:
        return inputs

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        floating = tensor.is_floating_point() and tensor.dtype is not torch.float64
        return tensor.float() if floating and tensor.device.type in device_types else tensor

    return map_tensors(cast, inputs)


def _post_hook(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
    frames = STATE.frames
    if not frames or frames[-1][0] is not module:
        return
    _, saved = frames.pop()
    if saved is None:
        return
    precision, enabled, was_low = saved
    if precision == "low":
        if STATE.mode is not None:
            STATE.mode.low = was_low
        return
    for dev, was_enabled in enabled.items():
        torch.set_autocast_enabled(dev, was_enabled)


class _GlobalHooks:
    """The two global module hooks, installed while any module-rule region is open."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._handles: list[Any] = []
        self.traced = False  # a graph may hold them: they stay installed, idle

    def acquire(self) -> None:
        if _is_compiling():
            # Dynamo cannot enter a lock nor register hooks in a graph: the engine runs
            # install_traced for real while tracing (the hooks are traced into every
            # module call after it); the graph counts.
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

    def install_traced(self) -> None:
        """Install the hooks for a graph being traced: they stay installed."""
        with self._lock:
            self.install()
            self.traced = True

    def compile_started(self) -> None:
        """torch.compile is starting: if installed, a graph may trace the hooks."""
        if self._handles:
            self.traced = True

    def release(self) -> None:
        """One user fewer; with none left, remove the hooks, unless a graph may hold them."""
        if _is_compiling():  # a graph cannot remove them: the next eager release may
            self._users -= 1
            return
        with self._lock:
            self._users -= 1
            if self._users == 0 and not self.traced:
                for handle in self._handles:
                    handle.remove()
                self._handles = []


hooks = _GlobalHooks()
