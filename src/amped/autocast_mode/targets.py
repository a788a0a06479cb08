"""Where an op named in a policy shows up at the Python level.

A :class:`~torch.overrides.TorchFunctionMode` sees Python callables, not ATen ops:
``torch.mm``, ``Tensor.mm``, ``Tensor.__matmul__``, ``torch._C._nn.linear`` (which is
``F.linear``), ``torch._C._linalg.linalg_vecdot`` (``torch.linalg.vecdot``). This module
maps an ATen name to every C-level callable that binds it, plus a few Python-exposed
C++ composites that do nothing but forward to one listed op (``nll_loss_nd`` calls
``nll_loss`` or ``nll_loss2d``), so a rule for the op applies to them too.

Python-level wrappers (``F.softmax``, ``torch.norm``, ``Tensor.__rpow__``) need no entry:
the engine runs them transparently and sees the C-level call inside.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from amped._internal import torch_compat

__all__ = ["PYTHON_OP", "callables_for", "is_python_op"]

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


@functools.cache
def callables_for(name: str) -> tuple[Callable[..., Any], ...]:
    """Every C-level callable through which Python code reaches the ATen op ``name``
    (or, for ``"namespace::name"``, the custom op's packet and its overloads)."""
    if "::" in name:
        namespace, _, short = name.partition("::")
        packet = getattr(getattr(torch.ops, namespace), short)
        return (packet, *(getattr(packet, o) for o in packet.overloads()))
    found: list[Callable[..., Any]] = []
    for attr in (name, *_DUNDERS.get(name, ()), *_FORWARDERS.get(name, ())):
        for namespace in _NAMESPACES:
            fn = namespace.__dict__.get(attr) if isinstance(namespace, type) else None
            if fn is None:
                fn = getattr(namespace, attr, None)
            if fn is not None and _is_builtin(fn) and fn not in found:
                found.append(fn)
    return tuple(found)


def _is_builtin(fn: object) -> bool:
    # Python functions are run transparently by the engine; only C bindings are targets.
    return (
        callable(fn)
        and not isinstance(fn, type)
        and type(fn).__name__
        in {
            "builtin_function_or_method",
            "method_descriptor",
            "wrapper_descriptor",
        }
    )
