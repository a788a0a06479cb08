"""``custom_fwd`` / ``custom_bwd``: autocast for custom ``torch.autograd.Function`` s.

torch's ``torch.amp.custom_fwd`` / ``custom_bwd``, plus the active amped policy:
``backward`` runs under the policy ``forward`` ran under.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from amped._internal import torch_compat
from amped._internal.errors import type_error
from amped.autocast_mode import compiling
from amped.autocast_mode.mode import AutocastMode, merged_rules
from amped.autocast_mode.region import autocast
from amped.autocast_mode.state import STATE, current_policy, innermost_policies
from amped.autocast_mode.targets import PYTHON_OP

__all__ = ["autocast_op", "custom_bwd", "custom_fwd"]


def _check_device_type(device_type: object) -> None:
    if not isinstance(device_type, str):
        raise ValueError(f"Expected `device_type` of type `str`, got: `{type(device_type)}`")


def custom_fwd(
    fwd: Callable[..., Any] | None = None,
    *,
    device_type: str,
    cast_inputs: torch.dtype | None = None,
) -> Any:
    """Decorate the ``forward`` of a custom autograd Function for autocast.

    Args:
        device_type: the device type whose autocast state applies (``"cpu"``, ``"cuda"``).
        cast_inputs: if given and ``forward`` runs in an enabled region, floating
            tensors on ``device_type`` are cast to this dtype and ``forward`` runs with
            autocast disabled. If None, ``forward``'s ops follow the current region.

    Example:
        >>> import torch, amped
        >>> class Square(torch.autograd.Function):
        ...     @staticmethod
        ...     @amped.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
        ...     def forward(ctx, x):
        ...         ctx.save_for_backward(x)
        ...         return x * x
        ...     @staticmethod
        ...     @amped.custom_bwd(device_type="cpu")
        ...     def backward(ctx, grad):
        ...         (x,) = ctx.saved_tensors
        ...         return 2 * x * grad
        >>> with amped.autocast("cpu"):
        ...     Square.apply(torch.ones(2, dtype=torch.bfloat16)).dtype
        torch.float32
    """
    _check_device_type(device_type)
    if fwd is None:
        return functools.partial(custom_fwd, device_type=device_type, cast_inputs=cast_inputs)
    torch_fwd = torch.amp.custom_fwd(fwd, device_type=device_type, cast_inputs=cast_inputs)

    @functools.wraps(fwd)
    def decorate_fwd(*args: Any, **kwargs: Any) -> Any:
        args[0]._amped_policy = current_policy(device_type)  # for custom_bwd
        return torch_fwd(*args, **kwargs)

    return decorate_fwd


def custom_bwd(bwd: Callable[..., Any] | None = None, *, device_type: str) -> Any:
    """Decorate the ``backward`` of a custom autograd Function: run it with the
    autocast state (and amped policy) that ``forward`` ran with.

    Args:
        device_type: the device type whose autocast state applies.
    """
    _check_device_type(device_type)
    if bwd is None:
        return functools.partial(custom_bwd, device_type=device_type)

    @functools.wraps(bwd)
    def decorate_bwd(*args: Any, **kwargs: Any) -> Any:
        ctx = args[0]
        policy = getattr(ctx, "_amped_policy", None)
        with autocast(
            device_type=device_type,
            enabled=ctx._fwd_used_autocast,
            dtype=ctx._dtype,
            policy=policy,
        ):
            return bwd(*args, **kwargs)

    return decorate_bwd


def autocast_op(func: Callable[..., Any]) -> Callable[..., Any]:
    """Make a Python function an op that autocast policies can name.

    A plain Python function is invisible to autocast (its inner torch calls are seen one
    by one). Decorate it, then list the decorated function in a policy to cast its
    inputs as a whole: under a rule, the function runs on the cast inputs with autocast
    off for their device type, as a custom op listed in torch's autocast does. Every
    tensor argument (also inside lists and tuples) counts: for the device type, and for
    ``__torch_function__`` overrides (tensor subclasses, torch-function modes, amped's
    own mode engine), which see the decorated function as one call.

    Where no mode is on the torch-function stack (the ``TORCH`` and ``KERNELS`` paths:
    docs/engine.md) the decorated function looks its rule up itself, so naming one in a
    policy keeps the policy on those paths.

    Example:
        >>> import torch, amped
        >>> @amped.autocast_op
        ... def scaled_dot(q, k):
        ...     return (q * k).sum(-1) / q.shape[-1] ** 0.5
        >>> policy = amped.Policy.preset("torch", "cpu").with_ops(lower=[scaled_dot])
        >>> with amped.autocast("cpu", policy=policy):
        ...     scaled_dot(torch.randn(2, 4), torch.randn(2, 4)).dtype
        torch.bfloat16
    """
    if not callable(func):
        raise type_error("autocast_op decorates a function", "func", func)

    @functools.wraps(func)
    def op(*args: Any, **kwargs: Any) -> Any:
        relevant: list[torch.Tensor] = []  # every tensor argument, in lists and tuples too
        for value in (*args, *kwargs.values()):
            if isinstance(value, (list, tuple)):
                relevant.extend(v for v in value if isinstance(v, torch.Tensor))
            elif isinstance(value, torch.Tensor):
                relevant.append(value)
        # A mode or a subclass: the override protocol. (Dynamo folds has_torch_function
        # to False for plain tensors even with a traced region's mode on the stack.)
        if _has_torch_function(relevant) or (_is_compiling() and _mode_enabled()):
            return _handle_torch_function(op, relevant, *args, **kwargs)
        if STATE.regions and not _is_compiling():
            return _run_python_op(op, func, args, kwargs)
        return func(*args, **kwargs)

    setattr(op, PYTHON_OP, True)
    return op


_has_torch_function = torch.overrides.has_torch_function
_handle_torch_function = torch.overrides.handle_torch_function
_is_compiling = compiling.tracing
_mode_enabled = torch_compat.torch_function_mode_enabled


def _run_python_op(
    op: Callable[..., Any], func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    # func (of op) under the rule the open regions give op, as the mode applies it.
    st = STATE
    per_device = merged_rules(innermost_policies(st.regions)).get(op)
    if per_device is None:
        return func(*args, **kwargs)
    runner = st.runner
    if runner is None:
        runner = st.runner = AutocastMode(cache=st.cache)
    return runner.run_listed(func, per_device, args, kwargs)
