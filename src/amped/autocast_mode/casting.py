"""Casting the arguments of one op call according to its :class:`~amped.policy.Cast`.

Mirrors ``at::autocast::cached_cast`` and the ``WrapFunction_`` policies in torch's
``autocast_mode.h``: only floating tensors on the region's device type are cast, float64
never is, and weights cast to the low dtype go through the :class:`WeightCache`. The
cast is a plain ``Tensor.to``, so gradients flow back to the float32 originals.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from amped._internal import torch_compat
from amped.policy import Cast

__all__ = ["WeightCache", "banned_error", "cast_call", "device_type_of", "first_eligible", "run"]

_Tensor = torch.Tensor
_FLOAT32 = torch.float32
_FLOAT64 = torch.float64
_is_cached_tensor = torch_compat.is_cached_tensor  # CUDA-graph pools
_grad_enabled = torch.is_grad_enabled
_inference_mode = torch_compat.is_inference_mode_enabled
_cache_enabled = torch.is_autocast_cache_enabled
# The dtypes autocast casts (a set look-up is cheaper than Tensor.is_floating_point()).
_CASTABLE = frozenset(
    d for d in vars(torch).values() if isinstance(d, torch.dtype) and d.is_floating_point
) - {_FLOAT64}

BINARY_CROSS_ENTROPY_BANNED = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using "
    "torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast."
)


class WeightCache:
    """Low-precision copies of weights, kept until the outermost region closes.

    torch's rule (docs/engine.md, "The weight cache"): a float32 leaf that requires grad
    is cast once per grad mode and served again, even if changed in place meanwhile;
    nothing is cached under ``torch.inference_mode()`` or with the cache disabled. An
    entry holds its source tensor, so the id cannot be reused while the entry lives.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[int, torch.dtype, bool], tuple[torch.Tensor, torch.Tensor]] = {}

    def cast(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``weight.to(dtype)`` for a leaf that requires grad, served from the cache
        where torch's rule allows."""
        key = (id(weight), dtype, _grad_enabled())
        entry = self._entries.get(key)
        usable = _cache_enabled() and not _inference_mode()
        if entry is not None and entry[0] is weight and usable:
            return entry[1]
        casted = weight.to(dtype)
        cacheable = weight.dtype is _FLOAT32 and not weight._is_view()
        if usable and cacheable and not _is_cached_tensor(weight):
            self._entries[key] = (weight, casted)
        return casted

    def clear(self) -> None:
        self._entries.clear()


def _eligible(t: torch.Tensor, device_type: str) -> bool:
    if t.dtype not in _CASTABLE:
        return False
    if device_type == "cpu":
        return t.is_cpu or t.is_mkldnn
    return t.device.type == device_type


def _cast(value: Any, dtype: torch.dtype, device_type: str, cache: WeightCache | None) -> Any:
    if isinstance(value, _Tensor):
        if value.dtype is dtype or not _eligible(value, device_type):
            return value
        # Activations are not leaves and inputs need no grad: both skip the cache at once.
        if cache is not None and value.requires_grad and value.is_leaf:
            return cache.cast(value, dtype)
        return value.to(dtype)
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], _Tensor):
        return type(value)(_cast(v, dtype, device_type, cache) for v in value)
    return value


def cast_call(
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dtype: torch.dtype,
    device_type: str,
    cache: WeightCache | None,
) -> Any:
    """``func`` called with its floating arguments on ``device_type`` cast to ``dtype``
    (``cache``: the weight cache, for a cast to the region's low dtype, else None).

    The per-op hot path: a tensor argument on the CPU is handled inline."""
    cast_args = []
    on_cpu = device_type == "cpu"
    for a in args:
        if isinstance(a, _Tensor):
            t_dtype = a.dtype
            if (
                t_dtype is not dtype
                and t_dtype in _CASTABLE
                and ((a.is_cpu or a.is_mkldnn) if on_cpu else a.device.type == device_type)
            ):
                if cache is not None and a.requires_grad and a.is_leaf:
                    a = cache.cast(a, dtype)
                else:
                    a = a.to(dtype)
        elif isinstance(a, (list, tuple)) and a and isinstance(a[0], _Tensor):
            a = _cast(a, dtype, device_type, cache)
        cast_args.append(a)
    if kwargs:
        kwargs = {k: _cast(v, dtype, device_type, cache) for k, v in kwargs.items()}
        return func(*cast_args, **kwargs)
    return func(*cast_args)


def first_eligible(args: tuple[Any, ...], kwargs: dict[str, Any], device_type: str) -> bool:
    """Whether the call's first argument is a tensor autocast would cast."""
    first = args[0] if args else kwargs.get("input", kwargs.get("self"))
    return isinstance(first, _Tensor) and _eligible(first, device_type)


def _promote_type(values: Any, device_type: str, low: torch.dtype) -> torch.dtype:
    # at::autocast::prioritize: float32 wins over the low dtype, float64 is ignored.
    current = low
    for value in values:
        items = value if isinstance(value, (list, tuple)) else (value,)
        for t in items:
            if not isinstance(t, _Tensor) or not _eligible(t, device_type):
                continue
            if t.dtype is _FLOAT32:
                current = _FLOAT32
            elif t.dtype is not low:
                raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return current


def _to_low(out: Any, low: torch.dtype) -> Any:
    if isinstance(out, _Tensor):
        return out.to(low) if out.dtype is _FLOAT32 else out
    if isinstance(out, (list, tuple)):  # (a torch.return_types tuple keeps its type)
        items = [_to_low(o, low) for o in out]
        return items if isinstance(out, list) else type(out)(items)
    return out


def run(
    cast: Cast,
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device_type: str,
    low: torch.dtype,
    cache: WeightCache | None,
) -> Any:
    """Call ``func`` with its arguments cast as ``cast`` says, in a region of dtype ``low``."""
    if cast is Cast.LOWER:
        return cast_call(func, args, kwargs, low, device_type, cache)
    if cast is Cast.FP32:
        return cast_call(func, args, kwargs, _FLOAT32, device_type, None)
    if cast is Cast.FP32_SET_OPT_DTYPE or cast is Cast.FP32_APPEND_DTYPE:
        dtype_given = kwargs.get("dtype") is not None or any(
            isinstance(a, torch.dtype) for a in args
        )
        if first_eligible(args, kwargs, device_type) and not dtype_given:
            kwargs = {**kwargs, "dtype": _FLOAT32}
            if cast is Cast.FP32_APPEND_DTYPE and len(args) < 2 and "p" not in kwargs:
                kwargs["p"] = 2  # norm(x) is norm(x, p=2); the dtype overload needs p spelled out
        return func(*args, **kwargs)
    if cast is Cast.PROMOTE:
        to = _promote_type((*args, *kwargs.values()), device_type, low)
        return cast_call(func, args, kwargs, to, device_type, cache if to is low else None)
    if cast is Cast.FP32_LOW_OUT:
        return _to_low(cast_call(func, args, kwargs, _FLOAT32, device_type, None), low)
    if cast is Cast.KEEP:
        return func(*args, **kwargs)
    if cast is Cast.BANNED:
        raise banned_error(getattr(func, "__name__", str(func)))
    raise AssertionError(f"unhandled cast {cast!r}")  # every Cast member is handled above


def banned_error(op_name: str) -> RuntimeError:
    """The error a banned op raises inside a region (torch's own text for its one)."""
    if op_name == "binary_cross_entropy":
        return RuntimeError(BINARY_CROSS_ENTROPY_BANNED)
    return RuntimeError(
        f"{op_name} is banned inside an autocast region by the active policy. Run it "
        "outside the region, or move it to another category with Policy.with_ops()."
    )


def device_type_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The device type whose autocast rules apply to a call, as torch's dispatcher picks it.

    An accelerator tensor anywhere in the arguments wins over CPU tensors (a CPU scalar
    tensor next to CUDA tensors still dispatches to CUDA).
    """
    found = _device_type_in(args)
    if not kwargs or (found is not None and found != "cpu"):
        return found
    return _device_type_in(kwargs.values()) or found


def _device_type_in(values: Any) -> str | None:
    # (Loops unrolled by hand: this runs per listed op, and a generator costs more.)
    found = None
    for value in values:
        if isinstance(value, _Tensor):
            if not value.is_cpu:
                return value.device.type
            found = "cpu"
        elif isinstance(value, (list, tuple)):
            for t in value:
                if isinstance(t, _Tensor):
                    if not t.is_cpu:
                        return t.device.type
                    found = "cpu"
    return found
