"""Where an op named in a policy shows up at the Python level: every C-level callable
that binds the ATen op (``torch.mm``, ``Tensor.__matmul__``, ``torch._C._nn.linear``),
plus Python-exposed C++ composites that only forward to it (``nll_loss_nd``). Python
wrappers (``F.softmax``) need no entry: the mode runs them transparently.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from amped._internal import torch_compat
from amped.policy import Cast, Policy
from amped.policy.ops import torch_default_rules
from amped.policy.policy import LOW_DTYPES

__all__ = ["PYTHON_OP", "callables_for", "is_python_op", "op_packet", "rules_of"]

PYTHON_OP = "_amped_python_op"
"""The attribute :func:`amped.autocast_op` sets on the functions it makes: they apply
their own rule where no mode is on the stack (amped.autocast_mode.custom)."""


def is_python_op(op: object) -> bool:
    """Whether ``op`` is an :func:`amped.autocast_op` function."""
    return getattr(op, PYTHON_OP, False) is True


# C-level namespaces whose functions are bound to ATen ops by name.
_NAMESPACES = torch_compat.OP_NAMESPACES

# Operator methods of Tensor implemented in C that bind an op under another name.
_DUNDERS = {
    "matmul": ("__matmul__",),
    "pow": ("__pow__",),
}

# Python-exposed C++ composites that only forward to the listed op named here.
_FORWARDERS = {
    "nll_loss": ("nll_loss_nd",),
    "softmax": ("special_softmax",),
    "log_softmax": ("special_log_softmax",),
}


def rules_of(policy: Policy) -> Iterator[tuple[torch.dtype, object, Cast, bool]]:
    """(low dtype, op key, cast, whether the rule is torch's own) for every op rule of
    ``policy``: the mode and the kernels build their tables from these."""
    torch_rules = torch_default_rules(policy.device_type)
    for dtype in LOW_DTYPES:
        for op, cast in policy.rules_for(dtype).items():
            torchs = isinstance(op, str) and "::" not in op and torch_rules.get(op) is cast
            yield dtype, op, cast, torchs


def op_packet(op: object) -> Any:
    """The dispatcher op (``OpOverloadPacket``) a policy's op key names (``"mm"``,
    ``"ns::name"``, a ``torch.library`` custom op or one of its overloads), or None."""
    if isinstance(op, str):
        namespace, _, name = op.rpartition("::")
        op = getattr(getattr(torch.ops, namespace or "aten"), name, None)
    op = getattr(op, "_opoverload", op)  # torch.library.custom_op's CustomOpDef
    if isinstance(op, torch_compat.OpOverload):
        op = op.overloadpacket
    return op if isinstance(op, torch_compat.OpOverloadPacket) else None


def callables_for(op: object) -> tuple[Callable[..., Any], ...]:
    """Every callable through which Python code reaches the op a policy names: the
    C-level bindings of an ATen op, a custom op's packet and overloads (what calling a
    ``@custom_op`` function reaches), or the function itself (``@amped.autocast_op``)."""
    if isinstance(op, str) and "::" not in op:
        return _aten_callables(op)
    packet = op_packet(op)
    if packet is None:
        return (op,)  # type: ignore[return-value]
    return (packet, *(getattr(packet, name) for name in packet.overloads()))


@functools.cache
def _aten_callables(name: str) -> tuple[Callable[..., Any], ...]:
    found: list[Callable[..., Any]] = []
    for attr in (name, *_DUNDERS.get(name, ()), *_FORWARDERS.get(name, ())):
        for namespace in _NAMESPACES:
            fn = namespace.__dict__.get(attr) if isinstance(namespace, type) else None
            if fn is None:
                fn = getattr(namespace, attr, None)
            if isinstance(fn, _BUILTIN_TYPES) and fn not in found:
                found.append(fn)
    return tuple(found)


# C bindings only: Python functions are run transparently by the engine.
_BUILTIN_TYPES = (
    types.BuiltinFunctionType,
    types.MethodDescriptorType,
    types.WrapperDescriptorType,
)
