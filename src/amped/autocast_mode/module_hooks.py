"""Module rules as global module hooks, installed while a region whose policy has some is
open (docs/engine.md, "Module rules are module hooks"). ``"fp32"`` and ``"skip"`` run as
``torch.amp.custom_fwd`` runs a function; ``"low"`` sets the mode's low flag.

``"fp32"`` is the one float32-module rule (:mod:`.float32_modules`), which the O2
recipes' norm hooks apply too. A global forward pre-hook receives no keyword inputs, so
the rule takes two: the first decides and casts the positional inputs, and marks the
module so that torch hands the second its keyword inputs in the same call
(:func:`amped._internal.torch_compat.mark_keywords`); the second takes the mark off.
"""

from __future__ import annotations

import threading
from typing import Any, cast

import torch
from torch.nn.modules import module as nn_module

from amped._internal.torch_compat import mark_keywords, unmark_keywords
from amped.autocast_mode import compiling
from amped.autocast_mode.float32_modules import (
    autocast_off,
    cast_on,
    float32_inputs,
    restore_autocast,
)
from amped.autocast_mode.state import STATE, kept
from amped.policy import ModuleRule, Policy

__all__ = ["hooks"]

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
    if rule.precision == "low":  # (its region runs the mode: engine._choose_path)
        enabled = {dev: torch.is_autocast_enabled(dev) for dev in policies}
        STATE.frames.append((module, ("low", enabled, STATE.mode.low)))
        STATE.mode.low = True
        return None
    enabled = autocast_off(policies)
    STATE.frames.append((module, (rule.precision, enabled, None)))
    if rule.precision != "fp32":
        return None
    on = cast_on(enabled)
    hook_id = hooks.keywords_id
    if on and hook_id is not None:  # torch calls _keywords_hook with them, next
        traced = _is_compiling()
        STATE.keywords = (module, on, mark_keywords(module, hook_id, traced), traced)
    return float32_inputs(args, on)


def _keywords_hook(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
) -> tuple[Any, Any] | None:
    """The ``"fp32"`` rule's keyword inputs: torch calls this hook with them right after
    :func:`_pre_hook` on a module it marked (without, on every other module)."""
    pending = STATE.keywords
    if kwargs is None or pending is None or pending[0] is not module:
        return None
    STATE.keywords = None
    _, on, table, traced = pending
    unmark_keywords(module, cast(int, hooks.keywords_id), table, traced)
    return args, float32_inputs(kwargs, on)


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
    restore_autocast(enabled)


class _GlobalHooks:
    """The global module hooks, installed while any module-rule region is open."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._handles: list[Any] = []
        self.keywords_id: int | None = None  # _keywords_hook's handle id, while installed
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
            # torch annotates the hooks as returning None; returning new args is
            # documented and supported. torch calls global pre-hooks in the order they
            # were registered: _keywords_hook right after _pre_hook.
            pre = nn_module.register_module_forward_pre_hook(cast(Any, _pre_hook))
            keywords = nn_module.register_module_forward_pre_hook(cast(Any, _keywords_hook))
            post = nn_module.register_module_forward_hook(_post_hook, always_call=True)
            self._handles = [pre, keywords, post]
            self.keywords_id = keywords.id

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
                self.keywords_id = None


hooks = _GlobalHooks()
