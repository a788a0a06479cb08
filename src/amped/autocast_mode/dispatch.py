"""The ``KERNELS`` path: a policy's changed op rules as kernels at torch's Autocast keys.

For just the ops whose rule differs from torch's, amped registers a Python kernel at
``AutocastCPU`` / ``AutocastCUDA``. It applies amped's rule while a ``KERNELS`` region
is open on this thread and lists the op; otherwise it does exactly what torch does.
Kernels stay registered, idle, until :func:`release_kernels` (registering per region
would cost more than the region). Eager code only: docs/engine.md, "torch.compile".
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import torch

from amped._internal import torch_compat
from amped._internal.torch_compat import OpOverload
from amped.autocast_mode import casting, compiling, targets
from amped.autocast_mode.state import STATE, kept
from amped.policy import Cast, Policy

__all__ = ["kernel_rules", "plan", "register", "registered_ops", "release_kernels"]

_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}
# fp32_append_dtype: the overload torch's C++ autocast redispatches each one to.
_APPEND_DTYPE = {
    "aten::norm.Scalar": "ScalarOpt_dtype",
    "aten::norm.ScalarOpt_dim": "ScalarOpt_dim_dtype",
}

Tables = dict[OpOverload, dict[torch.dtype, Cast]]
"""op overload -> low dtype -> amped's cast, for the ops whose rule differs from torch's."""


_lock = threading.Lock()
_libraries: dict[tuple[str, str], torch.library.Library] = {}  # (overload, key) -> registration


def plan(policy: Policy, route_all: bool = False) -> Tables | None:
    """The kernel tables of ``policy``, or None when the dispatcher cannot apply its
    rules (an op that is no dispatcher op, a device type without an Autocast key).
    ``route_all``: torch's own rules too (the tests' forced ``KERNELS`` path)."""
    return kept(policy, ("fast_plan", route_all), lambda: _plan(policy, route_all))


def kernel_rules(policy: Policy, route_all: bool = False) -> dict[Any, dict[torch.dtype, Cast]]:
    """:func:`plan`'s tables keyed by ``op._op``, which the kernels hash in C per call."""
    key = ("kernel_rules", route_all)
    return kept(policy, key, lambda: {o._op: r for o, r in (plan(policy, route_all) or {}).items()})


def _plan(policy: Policy, route_all: bool) -> Tables | None:
    if policy.device_type not in _KEYS:
        return None
    tables: Tables = {}
    for dtype, op, cast, torchs in targets.rules_of(policy):
        if (torchs and not route_all) or targets.is_python_op(op):
            continue
        overloads = _overloads(op)
        if overloads is None:
            return None
        for overload in overloads:
            arguments = torch_compat.op_schema(overload).arguments
            if cast is Cast.FP32_SET_OPT_DTYPE and all(a.name != "dtype" for a in arguments):
                continue  # the overload has no dtype argument: torch leaves it alone
            if cast is Cast.FP32_APPEND_DTYPE and overload.name() not in _APPEND_DTYPE:
                continue  # likewise: torch's rule names just these overloads
            tables.setdefault(overload, {})[dtype] = cast
    return tables


def _overloads(op: Any) -> list[OpOverload] | None:
    packet = targets.op_packet(op)
    if packet is None:
        return None
    overloads = [getattr(packet, name) for name in packet.overloads()]
    # TorchScript-only overloads (aten::sum.int) have no dispatcher entry; out= and
    # in-place overloads are left alone, as torch's autocast leaves them.
    return [
        op
        for op in overloads
        if torch_compat.dispatch_has_kernel(op.name()) and not torch_compat.op_schema(op).is_mutable
    ]


def register(policy: Policy, tables: Tables) -> None:
    """Register the kernels ``tables`` needs (once per op overload and device key)."""
    key = _KEYS[policy.device_type]
    missing = [op for op in tables if (op.name(), key) not in _libraries]
    if not missing:
        return
    with _lock, warnings.catch_warnings():
        # "Overriding a previously registered kernel": torch's, which the kernel calls.
        warnings.simplefilter("ignore", UserWarning)
        for op in missing:
            if (op.name(), key) in _libraries:  # another thread registered it meanwhile
                continue
            lib = torch.library.Library(op.namespace, "IMPL")
            lib.impl(op, _kernel(op, policy.device_type, key), key)
            _libraries[(op.name(), key)] = lib


def registered_ops() -> list[tuple[str, str]]:
    """(op overload name, dispatch key) of every kernel amped has registered now."""
    return sorted(_libraries)


def release_kernels() -> None:
    """Undo every registration (no ``KERNELS`` region may be open; later ones register
    again): torch's own autocast kernels are in force again."""
    if any(STATE.kernels.values()):
        raise RuntimeError(
            "amped.autocast_mode.dispatch.release_kernels() was called inside an amped "
            "region that uses the kernels. Close the region first."
        )
    with _lock:
        for lib in _libraries.values():
            torch_compat.destroy_library(lib)
        _libraries.clear()


def _kernel(op: OpOverload, device_type: str, key: str) -> Any:
    """The kernel for ``op`` at ``key``."""
    raw = op._op
    dispatch_key = getattr(torch_compat.DispatchKey, key)
    torch_kernel = (
        torch.library.get_kernel(op, key) if torch_compat.has_kernel_for(op.name(), key) else None
    )
    appended = _APPEND_DTYPE.get(op.name())
    with_dtype = getattr(op.overloadpacket, appended)._op if appended else raw
    positional = [a for a in torch_compat.op_schema(op).arguments if not a.kwarg_only]
    defaults = [(a.name, a.default_value) for a in positional if a.has_default_value()]
    first_default = len(positional) - len(defaults)  # defaults are trailing in a schema
    tls = STATE
    get_dtype = torch.get_autocast_dtype
    run = casting.run
    is_compiling = compiling.tracing_flag
    # The dispatcher calls this kernel only while its key is not excluded, so the key is
    # excluded for the op and included again after it: two calls, where an exclude-guard
    # object costs several times more.
    set_excluded = torch_compat.set_dispatch_key_excluded

    def kernel(*args: Any, **kwargs: Any) -> Any:
        tables = tls.kernels.get(device_type)
        rule = tables.get(raw) if tables else None  # keyed by op._op: hashed in C
        cast = None
        if rule is not None:
            low = get_dtype(device_type)
            cast = rule.get(low)
        if cast is None and torch_kernel is not None:  # not ours here: exactly what torch does
            return torch_kernel.call_boxed(_ANY_KEYSET, *args, **kwargs)
        if cast is not None and is_compiling():
            raise RuntimeError(_TRACED_FAST)
        set_excluded(dispatch_key, True)
        try:
            if cast is None:
                # Not ours, and torch has no autocast kernel for it: the op runs again
                # with this key excluded, as torch's own autocast kernels call theirs
                # (the call already passed the torch-function layer: no mode sees it twice).
                with _no_torch_function():
                    return raw(*args, **kwargs)
            if cast is Cast.FP32_APPEND_DTYPE and casting.first_eligible(
                args, kwargs, device_type
            ):  # torch redispatches to the dtype overload, which has no defaults
                missing = defaults[max(len(args) - first_default, 0) :]
                filled = {name: value for name, value in missing if name not in kwargs}
                return with_dtype(*args, **kwargs, **filled, dtype=torch.float32)
            if cast is Cast.BANNED:  # raw (a C++ op) has no name to put in the error
                raise casting.banned_error(op._opname)
            return run(cast, raw, args, kwargs, device_type, low, tls.cache)
        finally:
            set_excluded(dispatch_key, False)

    kernel.__name__ = op._opname
    return kernel


_ANY_KEYSET = torch_compat.dispatch_keyset_full()  # torch's autocast kernels ignore it
_no_torch_function = torch_compat.DisableTorchFunction


_TRACED_FAST = (
    "torch.compile is tracing code inside an amped region that runs the eager fast path "
    "(torch._dynamo.reset() ran inside the region and removed amped's compile hook), "
    "and Dynamo could not guard on its policy. Open the region after "
    "torch._dynamo.reset(), or inside the compiled function."
)
