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

from amped.autocast_mode import casting, transparent
from amped.autocast_mode.targets import callables_for
from amped.policy import LOW_DTYPES, Cast, Policy, torch_default_rules

__all__ = ["AutocastMode", "compiled_rules"]

_FunctionType = types.FunctionType
_AUTOCAST_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
for _key in ("AutocastCUDA", "AutocastXPU", "AutocastMPS", "AutocastHPU", "AutocastPrivateUse1"):
    if hasattr(torch._C.DispatchKey, _key):
        _AUTOCAST_KEYS = _AUTOCAST_KEYS | torch._C.DispatchKeySet(
            getattr(torch._C.DispatchKey, _key)
        )

TORCH_AUTOCAST_ALONGSIDE = True
"""Let torch's C++ autocast run alongside amped: inside calls the policy does not name
(C++ composites such as ``aten::lstm``, whose inner casts it makes as under
``torch.autocast``), and after amped's casts on ops whose rule is torch's own (where it
finds nothing left to cast). The tests turn it off, so that every cast they see is
amped's own."""


Rule = tuple[Cast, bool]
"""An op's cast, and whether torch's C++ autocast must be kept out while it runs."""

_COMPILED: dict[tuple[Policy, torch.dtype], dict[Callable[..., Any], Rule]] = {}


def compiled_rules(policy: Policy, dtype: torch.dtype) -> dict[Callable[..., Any], Rule]:
    """The policy's rules under ``dtype``, keyed by the Python callables the mode sees.

    Where the rule is torch's own rule for the op, torch's C++ autocast kernel may run
    after amped's casts: it finds the inputs already in its dtype and does nothing
    (and it keeps the op's internals from being cast again, as amped would). Only
    where the rule differs, or the op is a Python function or custom op, must it be
    excluded, which costs about a microsecond per call.
    """
    key = (policy, dtype)
    found = _COMPILED.get(key)
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
    if len(_COMPILED) > 64:  # policies are few; keep the memo from growing without bound
        _COMPILED.clear()
    _COMPILED[key] = table
    return table


def _custom_targets(op: Callable[..., Any]) -> tuple[Callable[..., Any], ...]:
    # A custom op reaches the mode as its packet (torch.ops.ns.name) or as an overload
    # (torch.ops.ns.name.default, which is what calling a @custom_op function does).
    opdef = getattr(op, "_opoverload", None)  # torch.library.custom_op's CustomOpDef
    if isinstance(opdef, torch._ops.OpOverload):
        op = opdef.overloadpacket
    if isinstance(op, torch._ops.OpOverload):
        op = op.overloadpacket
    if isinstance(op, torch._ops.OpOverloadPacket):
        return (op, *(getattr(op, name) for name in op.overloads()))
    return (op,)


def exclude_torch_autocast() -> Any:
    """A guard under which torch's C++ autocast kernels do not run (one per use)."""
    return torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS)


class AutocastMode(TorchFunctionMode):
    """Applies the policies of the amped regions active on this thread.

    One instance per thread is on the torch-function stack while any amped region is
    open there; :mod:`amped.autocast_mode.state` keeps its fields current.
    """

    def __init__(self) -> None:
        super().__init__()
        self.policies: dict[str, Policy] = {}  # device type -> policy of the innermost region
        self.tables: dict[str, dict[torch.dtype, dict[Callable[..., Any], Rule]]] = {}
        self.listed: frozenset[Callable[..., Any]] = frozenset()
        self.override: str | None = None  # "fp32" / "low" inside a module rule
        self.cache = casting.WeightCache()
        self.running: set[Callable[..., Any]] = set()  # Python functions run transparently

    def refresh(self) -> None:
        """Recompute which callables any active policy lists (after a region change)."""
        self.tables = {
            device_type: {dtype: compiled_rules(policy, dtype) for dtype in LOW_DTYPES}
            for device_type, policy in self.policies.items()
        }
        self.listed = frozenset(
            fn for per_dtype in self.tables.values() for table in per_dtype.values() for fn in table
        )

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        if func in self.listed:
            return self._apply(func, args, kwargs)
        if type(func) is _FunctionType and func not in self.running:
            return transparent.run_transparently(self, self.running, func, types, args, kwargs)
        if self.override is not None or not TORCH_AUTOCAST_ALONGSIDE:
            with exclude_torch_autocast():
                return func(*args, **kwargs)
        return func(*args, **kwargs)

    def _apply(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        device_type = casting.device_type_of(args, kwargs)
        if device_type is None:
            return func(*args, **kwargs)
        tables = self.tables.get(device_type)
        if tables is None or not torch.is_autocast_enabled(device_type):
            return func(*args, **kwargs)
        low = torch.get_autocast_dtype(device_type)
        table = tables.get(low)
        rule = table.get(func) if table is not None else None
        if rule is None:
            return func(*args, **kwargs)
        cast, exclude = rule
        if self.override is not None and cast not in (Cast.KEEP, Cast.BANNED):
            cast, exclude = (Cast.FP32 if self.override == "fp32" else Cast.LOWER), True
        if not exclude and TORCH_AUTOCAST_ALONGSIDE:
            return casting.run(cast, func, args, kwargs, device_type, low, self.cache)
        with exclude_torch_autocast():
            return casting.run(cast, func, args, kwargs, device_type, low, self.cache)
