"""The ``MODE`` path: a TorchFunctionMode that applies the active policy op by op.

A C-level binding the policy lists (``torch.mm``, ``F.linear``) has its arguments cast
by :func:`amped.autocast_mode.casting.run`, with torch's C++ autocast excluded where the
rule is not torch's; a Python function (``F.softmax``) runs with the mode pushed again
(:mod:`~amped.autocast_mode.transparent`), so its inner ops reach the policy; anything
else runs unchanged, with torch's C++ autocast on as under ``torch.autocast``.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from amped._internal import torch_compat
from amped.autocast_mode import casting, compiling, transparent
from amped.autocast_mode.state import kept
from amped.autocast_mode.targets import callables_for, rules_of
from amped.policy import Cast, Policy

__all__ = ["AutocastMode", "call_without_torch_autocast", "merged_rules"]

_FunctionType = types.FunctionType
_is_compiling = compiling.tracing
# torch's autocast dispatch key per device type amped has policies for (policy.ops)
_AUTOCAST_KEY = {
    "cpu": torch_compat.DispatchKey.AutocastCPU,
    "cuda": torch_compat.DispatchKey.AutocastCUDA,
}
_AUTOCAST_KEYS = torch_compat.DispatchKeySet(_AUTOCAST_KEY["cpu"]) | torch_compat.DispatchKeySet(
    _AUTOCAST_KEY["cuda"]
)
_set_excluded = torch_compat.set_dispatch_key_excluded
_exclude_guard = torch_compat.ExcludeDispatchKeyGuard
_autocast_enabled = torch.is_autocast_enabled
_autocast_dtype = torch.get_autocast_dtype

Rule = tuple[Cast, bool]
"""An op's cast, and whether torch's C++ autocast must be kept out while it runs."""

PerDevice = dict[str, dict[torch.dtype, Rule]]


def merged_rules(policies: dict[str, Policy]) -> dict[Callable[..., Any], PerDevice]:
    """One dict for the active policies: callable -> device type -> low dtype -> rule
    (kept with the policy when there is one)."""
    if len(policies) == 1:
        ((_device_type, policy),) = policies.items()
        return kept(policy, "merged", lambda: _rules_of(policy))
    merged: dict[Callable[..., Any], PerDevice] = {}
    for policy in policies.values():
        for fn, per_device in merged_rules({policy.device_type: policy}).items():
            merged.setdefault(fn, {}).update(per_device)
    return merged


def _rules_of(policy: Policy) -> dict[Callable[..., Any], PerDevice]:
    # Keyed by the Python callables the mode sees. Where the rule is torch's own, torch's
    # C++ autocast kernel may run after amped's casts (it finds its dtype and does
    # nothing); elsewhere it is excluded, which costs about a microsecond per call.
    rules: dict[Callable[..., Any], PerDevice] = {}
    for dtype, op, cast, torchs in rules_of(policy):
        for fn in callables_for(op):
            rules.setdefault(fn, {}).setdefault(policy.device_type, {})[dtype] = (cast, not torchs)
    return rules


def call_without_torch_autocast(
    device_types: tuple[str, ...], func: Callable[..., Any], args: Any, kwargs: Any
) -> Any:
    """``func(*args, **kwargs)`` with torch's C++ autocast kept out: eagerly by an exclude
    guard, under ``torch.compile`` as Dynamo can trace it
    (:func:`compiling.without_torch_autocast_traced`, for ``device_types``)."""
    if not _is_compiling():
        with _exclude_guard(_AUTOCAST_KEYS):
            return func(*args, **kwargs)
    return compiling.without_torch_autocast_traced(device_types, func, args, kwargs)


_EMPTY: dict[str, Any] = {}
_OPAQUE = torch_compat.AUTOCAST_ENTER_EXIT


class AutocastMode(TorchFunctionMode):
    """Applies the policies of this thread's ``MODE`` regions (the engine keeps its
    fields current). Per call one dict look-up in ``rules`` (callable -> device type ->
    low dtype -> rule); Dynamo guards on the entries it reads."""

    def __init__(
        self, torch_alongside: bool = True, cache: casting.WeightCache | None = None
    ) -> None:
        super().__init__()
        self.refresh({})  # policies, device_types, rules: none active yet
        self.backward_token: Any = None  # compiled backward autocast turned off for it
        self.low = False  # inside a "low" module rule: every listed op runs low
        # torch's C++ autocast may run inside calls no policy lists, and after amped's
        # casts where the rule is torch's (off only in the tests' forced runs).
        self.alongside = torch_alongside
        self.cache = cache  # the thread's weight cache (None: no cast is cached)
        # Python functions run transparently just now, and those never to be: the graph
        # of a compiled region calls _enter_autocast/_exit_autocast, which hand
        # themselves to any mode whatever one-hop skip is set.
        self.running: dict[Callable[..., Any], None] = dict.fromkeys(_OPAQUE)

    def refresh(self, policies: dict[str, Policy]) -> None:
        """Make ``policies`` (device type -> policy of the innermost region) the active ones."""
        self.policies = policies
        self.device_types = tuple(policies)
        self.rules = merged_rules(policies)

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        per_device = self.rules.get(func)
        if per_device is not None:
            return self.run_listed(func, per_device, args, kwargs or _EMPTY)
        if type(func) is _FunctionType and func not in self.running:
            return transparent.run_transparently(
                self, self.running, func, types, args, kwargs or _EMPTY
            )
        return self.call_unlisted(func, args, kwargs or _EMPTY)

    def call_unlisted(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run a call no policy lists: plainly, or with torch's C++ autocast kept out
        where this region excludes it (``"low"`` rules, no torch alongside)."""
        if self.low or not self.alongside:
            return call_without_torch_autocast(self.device_types, func, args, kwargs)
        return func(*args, **kwargs)

    def run_listed(
        self,
        func: Callable[..., Any],
        per_device: dict[str, dict[torch.dtype, Rule]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Apply a listed op's rules to one call of ``func`` (also for an
        ``@amped.autocast_op`` function called where no mode is on the stack)."""
        device_type = casting.device_type_of(args, kwargs)
        if device_type is None:
            return func(*args, **kwargs)
        tables = per_device.get(device_type)
        if tables is None or not _autocast_enabled(device_type):
            return func(*args, **kwargs)
        low = _autocast_dtype(device_type)
        rule = tables.get(low)
        if rule is None:
            return func(*args, **kwargs)
        cast, exclude = rule
        if self.low and cast is not Cast.KEEP and cast is not Cast.BANNED:
            cast, exclude = Cast.LOWER, True
        # Under torch.compile no cast is cached (as torch's compiled autocast): the graph
        # holds each cast, and a cache keyed by tensor identity cannot be traced.
        cache = self.cache
        if _is_compiling():
            compiling.check_supported()
            cache = None
        if not exclude and self.alongside:
            return casting.run(cast, func, args, kwargs, device_type, low, cache)
        if cache is None:  # Dynamo is tracing
            return call_without_torch_autocast(
                (device_type,),
                casting.run,
                (cast, func, args, kwargs, device_type, low, cache),
                _EMPTY,
            )
        # Autocast is on for device_type (checked above), so its key is not excluded:
        # exclude it for the op, include it after (an exclude-guard object costs more).
        key = _AUTOCAST_KEY[device_type]  # (a policy's device type: cpu or cuda)
        _set_excluded(key, True)
        try:
            return casting.run(cast, func, args, kwargs, device_type, low, cache)
        finally:
            _set_excluded(key, False)
