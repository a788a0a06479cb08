"""The engine: a TorchFunctionMode that applies the active policy op by op.

Three kinds of call reach ``__torch_function__``:

* a C-level binding of an op the active policy lists (``torch.mm``, ``F.linear``):
  its arguments are cast by :func:`amped.autocast_mode.casting.run` and the op runs with
  torch's C++ autocast excluded, so the policy is authoritative and nothing is cast
  twice (this is what torch's own autocast kernels do);
* a Python function that dispatched to us through ``handle_torch_function``
  (``F.softmax``, ``F.multi_head_attention_forward``, ``Tensor.__rpow__``): it runs with
  the mode pushed again, one hop skipped, so every op inside it reaches the policy;
* anything else: it runs unchanged. torch's C++ autocast stays on for it, exactly as
  under ``torch.autocast``, so C++ composites that the policy does not name (``einsum``
  on CPU, ``pad``, ``lstm``) cast their inner ops as torch would.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from amped._internal import torch_compat
from amped.autocast_mode import casting, compiling, transparent
from amped.autocast_mode.targets import callables_for
from amped.policy import Cast, Policy
from amped.policy.ops import torch_default_rules
from amped.policy.policy import LOW_DTYPES

__all__ = [
    "AUTOCAST_DEVICE_TYPES",
    "AutocastMode",
    "compiled_rules",
    "merged_rules",
    "prepare",
]

_FunctionType = types.FunctionType
# Dynamo folds it to True while tracing; eagerly one frame (is_compiling() costs two).
_is_compiling = torch.compiler.is_dynamo_compiling
_AUTOCAST_KEY = {  # device type -> torch's autocast dispatch key for it
    device_type: getattr(torch_compat.DispatchKey, name)
    for device_type, name in (
        ("cpu", "AutocastCPU"),
        ("cuda", "AutocastCUDA"),
        ("xpu", "AutocastXPU"),
        ("mps", "AutocastMPS"),
        ("hpu", "AutocastHPU"),
        ("privateuseone", "AutocastPrivateUse1"),
    )
    if hasattr(torch_compat.DispatchKey, name)
}
AUTOCAST_DEVICE_TYPES = tuple(_AUTOCAST_KEY)
"""The device types torch's autocast has a dispatch key for in this build."""
_AUTOCAST_KEYS = torch_compat.DispatchKeySet(_AUTOCAST_KEY["cpu"])
for _key in _AUTOCAST_KEY.values():
    _AUTOCAST_KEYS = _AUTOCAST_KEYS | torch_compat.DispatchKeySet(_key)
_set_excluded = torch_compat.set_dispatch_key_excluded
_exclude_guard = torch_compat.ExcludeDispatchKeyGuard
_autocast_enabled = torch.is_autocast_enabled
_autocast_dtype = torch.get_autocast_dtype

Rule = tuple[Cast, bool]
"""An op's cast, and whether torch's C++ autocast must be kept out while it runs."""

PerDevice = dict[str, dict[torch.dtype, Rule]]


def compiled_rules(policy: Policy, dtype: torch.dtype) -> dict[Callable[..., Any], Rule]:
    """The policy's rules under ``dtype``, keyed by the Python callables the mode sees.

    Where the rule is torch's own rule for the op, torch's C++ autocast kernel may run
    after amped's casts: it finds the inputs already in its dtype and does nothing
    (and it keeps the op's internals from being cast again, as amped would). Only
    where the rule differs, or the op is a Python function or custom op, must it be
    excluded, which costs about a microsecond per call.

    Kept in the policy's engine cache, so it lives exactly as long as the policy.
    """
    cache = policy._engine_cache
    found = cache.get(dtype)
    if found is not None:
        return found
    torch_rules = torch_default_rules(policy.device_type)
    table: dict[Callable[..., Any], Rule] = {}
    for op, cast in policy.rules_for(dtype).items():
        if isinstance(op, str) and "::" not in op:
            exclude = torch_rules.get(op) is not cast
            for fn in callables_for(op):
                table[fn] = (cast, exclude)
        else:
            for fn in callables_for(op) if isinstance(op, str) else _custom_targets(op):
                table[fn] = (cast, True)
    cache[dtype] = table
    return table


def merged_rules(policies: dict[str, Policy]) -> dict[Callable[..., Any], PerDevice]:
    """One dict for the active policies: callable -> device type -> low dtype -> rule.

    For a single policy (the usual case) it is built once and kept with the policy.
    """
    if len(policies) == 1:
        ((_device_type, policy),) = policies.items()
        found = policy._engine_cache.get("merged")
        if found is None:
            found = _merge(policies)
            policy._engine_cache["merged"] = found
        return found
    return _merge(policies)


def _merge(policies: dict[str, Policy]) -> dict[Callable[..., Any], PerDevice]:
    rules: dict[Callable[..., Any], PerDevice] = {}
    for device_type, policy in policies.items():
        for dtype in LOW_DTYPES:
            for fn, rule in compiled_rules(policy, dtype).items():
                rules.setdefault(fn, {}).setdefault(device_type, {})[dtype] = rule
    return rules


def prepare(policy: Policy) -> None:
    """Build the engine's tables for ``policy`` now (it was just created): a region
    opened inside a compiled function then only reads them (Dynamo cannot build them)."""
    merged_rules({policy.device_type: policy})


def _custom_targets(op: Callable[..., Any]) -> tuple[Callable[..., Any], ...]:
    # A custom op reaches the mode as its packet (torch.ops.ns.name) or as an overload
    # (torch.ops.ns.name.default, which is what calling a @custom_op function does).
    opdef = getattr(op, "_opoverload", None)  # torch.library.custom_op's CustomOpDef
    if isinstance(opdef, torch_compat.OpOverload):
        op = opdef.overloadpacket
    if isinstance(op, torch_compat.OpOverload):
        op = op.overloadpacket
    if isinstance(op, torch_compat.OpOverloadPacket):
        return (op, *(getattr(op, name) for name in op.overloads()))
    return (op,)


def exclude_torch_autocast() -> Any:
    """A guard under which torch's C++ autocast kernels do not run (one per use)."""
    return _exclude_guard(_AUTOCAST_KEYS)


def call_without_torch_autocast(
    device_types: tuple[str, ...], func: Callable[..., Any], args: Any, kwargs: Any
) -> Any:
    """``func(*args, **kwargs)`` with torch's C++ autocast kept out.

    Eagerly an exclude guard does it. Dynamo cannot trace that guard, so under
    ``torch.compile`` the same effect comes from ``torch.autocast(enabled=False)`` for each
    device type amped governs: for a single op call both mean "no autocast kernel runs".
    """
    if not _is_compiling():
        with exclude_torch_autocast():
            return func(*args, **kwargs)
    compiling.check_supported()
    if not device_types:
        return func(*args, **kwargs)
    with torch.autocast(device_types[0], enabled=False):
        return call_without_torch_autocast(device_types[1:], func, args, kwargs)


_EMPTY: dict[str, Any] = {}
_LOWER = Cast.LOWER
_OPAQUE = torch_compat.AUTOCAST_ENTER_EXIT


class AutocastMode(TorchFunctionMode):
    """Applies the policies of the amped regions on the ``MODE`` path on this thread.

    One instance per thread is on the torch-function stack while such a region is open
    there; :mod:`amped.autocast_mode.engine` keeps its fields current.

    Per call it does one dict look-up: ``rules`` maps each callable some active policy
    lists to its rules per device type and low dtype. An unlisted C-level call costs
    that look-up and a type check; a Python function is run transparently. Dynamo
    traces the same method: it guards on the entries it reads, so a policy change
    between calls recompiles instead of reusing a stale graph.
    """

    def __init__(self, torch_alongside: bool = True) -> None:
        super().__init__()
        self.policies: dict[str, Policy] = {}  # device type -> policy of the innermost region
        self.device_types: tuple[str, ...] = ()
        self.rules: dict[Callable[..., Any], PerDevice] = {}
        self.on_stack = False
        self.backward_off = False  # compiled backward autocast turned off for it
        self.traced = False  # entered while Dynamo traces (the context-manager protocol)
        self.low = False  # inside a "low" module rule
        # torch's C++ autocast may run inside calls no policy lists, and after amped's
        # casts where the rule is torch's (off only in the tests' forced runs).
        self.alongside = torch_alongside
        self.exclude_unlisted = not torch_alongside
        self.cache: casting.WeightCache | None = None  # the thread's (engine.py sets it)
        # Python functions run transparently just now, and those never to be: the graph
        # of a compiled region calls _enter_autocast/_exit_autocast, which hand
        # themselves to any mode whatever one-hop skip is set.
        self.running: dict[Callable[..., Any], None] = dict.fromkeys(_OPAQUE)

    def refresh(self, policies: dict[str, Policy]) -> None:
        """Make ``policies`` (device type -> policy) the active ones."""
        self.policies = policies
        self.device_types = tuple(policies)
        self.rules = merged_rules(policies)

    def set_low(self, low: bool) -> None:
        """Enter (True) or leave a ``"low"`` module rule: every listed op runs low."""
        self.low = low
        self.exclude_unlisted = low or not self.alongside

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
        if self.exclude_unlisted:
            return call_without_torch_autocast(self.device_types, func, args, kwargs or _EMPTY)
        if kwargs:
            return func(*args, **kwargs)
        return func(*args)

    def call_unlisted(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run a call no policy lists with torch's C++ autocast kept out."""
        return call_without_torch_autocast(self.device_types, func, args, kwargs)

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
            if cast is _LOWER:  # the hot path: one frame less than casting.run
                return casting.cast_call(func, args, kwargs, low, device_type, low, cache)
            return casting.run(cast, func, args, kwargs, device_type, low, cache)
        key = _AUTOCAST_KEY.get(device_type)
        if key is None or cache is None:  # (no cache: Dynamo is tracing)
            return call_without_torch_autocast(
                (device_type,),
                casting.run,
                (cast, func, args, kwargs, device_type, low, cache),
                _EMPTY,
            )
        # Autocast is on for device_type (checked above), so its key is not excluded:
        # exclude it for the op, include it after (an exclude-guard object costs more).
        _set_excluded(key, True)
        try:
            return casting.run(cast, func, args, kwargs, device_type, low, cache)
        finally:
            _set_excluded(key, False)
