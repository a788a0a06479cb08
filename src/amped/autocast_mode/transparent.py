"""Run a Python-level torch function so that the ops inside it stay visible to the mode.

torch pops a TorchFunctionMode while it handles a call, so a Python composite
(``F.multi_head_attention_forward``) would run its inner ops unseen. The mode pushes
itself again and calls the function with its own torch-function check skipped once:
torch >= 2.13 offers that (``torch._C._skip_one_hop_torch_function``); older releases
(2.11 has none) call a copy of the function whose ``has_torch_function*`` globals
return False, which is also what Dynamo traces.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, cast

import torch.overrides

from amped._internal import torch_compat
from amped.autocast_mode import compiling, targets

__all__ = ["call", "call_with_clone", "prepare_clones", "run_transparently"]

_CHECKS = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")
_GLOBALS: dict[int, dict[str, Any]] = {}  # id of a module's globals -> their transparent copy
_CLONES: dict[Any, Any] = {}  # function -> its clone (a plain dict, which Dynamo can read)


def _never(*args: Any, **kwargs: Any) -> bool:
    return False


def _clone(func: types.FunctionType) -> types.FunctionType:
    clone = _CLONES.get(func)
    if clone is None:
        module_globals = _GLOBALS.get(id(func.__globals__))
        if module_globals is None:
            module_globals = dict(func.__globals__)
            module_globals.update({name: _never for name in _CHECKS if name in module_globals})
            _GLOBALS[id(func.__globals__)] = module_globals
        clone = types.FunctionType(
            func.__code__, module_globals, func.__name__, func.__defaults__, func.__closure__
        )
        clone.__kwdefaults__ = func.__kwdefaults__
        clone.__dict__.update(func.__dict__)
        _CLONES[func] = clone
    return clone


_clone_outside_graph = compiling.outside_graph(_clone)


def prepare_clones() -> None:
    """Clone torch's Python-level functions ahead of time, so that a compiled function
    finds each one in a plain dict (Dynamo cannot trace building one)."""
    if _CLONES:
        return
    import torch.nn.functional

    for namespace in (torch.nn.functional, torch.functional, torch.Tensor, torch):
        for value in list(vars(namespace).values()):
            if isinstance(value, types.FunctionType) and value.__module__.startswith("torch"):
                _clone(value)


def call_with_clone(func: Any, types_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The fallback for torch releases without the one-hop skip (2.11)."""
    return _clone(func)(*args, **kwargs)


_skip_one_hop = torch_compat.skip_one_hop_torch_function
call: Callable[..., Any] = _skip_one_hop if _skip_one_hop is not None else call_with_clone
"""Call a Python torch function with its own torch-function check skipped once
(``torch.overrides.redispatch_function`` is a thin wrapper over the C function)."""

_is_compiling = compiling.tracing
_push = torch_compat.push_torch_function_mode
_pop = torch_compat.pop_torch_function_mode


SUPER_FORWARDERS = tuple(
    value
    for value in vars(torch.Tensor).values()
    if isinstance(value, types.FunctionType) and "super" in value.__code__.co_names
)
"""``torch.Tensor`` methods written in Python that end in ``super().name(...)``
(``Tensor.unflatten``): Dynamo cannot trace that ``super()`` call, so under
``torch.compile`` they run as the tensor method they forward to, one graph node."""


def _run_traced(
    mode: Any, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    # Dynamo does not honour the one-hop skip (the function comes straight back to the
    # mode) and records torch's Python functions as single graph nodes. It inlines the
    # clone, whose checks are off, with the mode entered again as a context manager.
    if func in SUPER_FORWARDERS:
        # Eagerly only its super() call comes back to the mode, as an unlisted op; here
        # the mode is off while it handles a call, so the method is that op directly
        # (run as unlisted, not looked up in the rules: Dynamo cannot hash a bound method).
        method = getattr(args[0], func.__name__)
        return mode.call_unlisted(method, args[1:], kwargs)
    if targets.is_python_op(func):  # an @amped.autocast_op no rule names: its own body
        with mode:
            return cast(Any, func).__wrapped__(*args, **kwargs)
    clone = _CLONES.get(func)
    if clone is None:
        clone = _clone_outside_graph(func)
    with mode:
        return clone(*args, **kwargs)


def run_transparently(
    mode: Any,
    running: dict[Callable[..., Any], None],
    func: Callable[..., Any],
    types_: tuple[type, ...],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """``call`` with ``mode`` pushed again, so the ops inside ``func`` reach it, with
    ``func`` in ``running`` (a dict used as a set, which Dynamo traces) while it runs:
    a method ending in ``super().same_name()`` (``Tensor.unflatten``) comes back to the
    mode as itself, which then runs that inner call plainly."""
    running[func] = None
    try:
        if _is_compiling():
            compiling.check_supported()
            return _run_traced(mode, func, args, kwargs)
        _push(mode)
        try:
            return call(func, types_, args, kwargs)
        finally:
            _pop()
    finally:
        running.pop(func, None)
