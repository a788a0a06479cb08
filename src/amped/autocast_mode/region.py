"""``amped.autocast``: the region, as context manager and decorator."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from amped._internal import torch_compat
from amped._internal.errors import type_error
from amped.autocast_mode import compiling, engine
from amped.autocast_mode.state import Region
from amped.policy import Policy
from amped.policy.ops import TORCH_OP_TABLES

__all__ = ["autocast"]

F = TypeVar("F", bound=Callable[..., Any])
_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


def _resolve_policy(policy: Policy | str | None, device_type: str) -> Policy | None:
    if device_type not in TORCH_OP_TABLES:
        if policy is not None:
            raise ValueError(
                f"amped has autocast policies for device types {list(TORCH_OP_TABLES)}; on "
                f"{device_type!r} torch's own autocast runs without one. Drop the policy "
                f"argument there. Received: device_type={device_type!r}, policy={policy!r}"
            )
        return None
    if policy is None:
        return _preset("torch", device_type)
    if isinstance(policy, str):
        return _preset(policy, device_type)
    if not isinstance(policy, Policy):
        raise type_error(
            "policy must be an amped.Policy, a preset name ('torch', 'strict') or None",
            "policy",
            policy,
        )
    if policy.device_type != device_type:
        raise ValueError(
            f"This policy is for {policy.device_type!r} but the region is for "
            f"{device_type!r}; build one with Policy.preset(name, {device_type!r}). "
            f"Received: device_type={device_type!r}, policy={policy!r}"
        )
    return policy


def _preset(name: str, device_type: str) -> Policy:
    # Policy.preset is memoised by functools.cache, which Dynamo cannot trace: a region
    # opened inside a compiled function reads this plain dict (only a preset never used
    # before costs a graph break, to build it).
    found = _PRESETS.get((name, device_type))
    return found if found is not None else _build_preset(name, device_type)


@compiling.outside_graph
def _build_preset(name: str, device_type: str) -> Policy:
    return _PRESETS.setdefault((name, device_type), Policy.preset(name, device_type))


_PRESETS = {
    ("torch", device_type): Policy.preset("torch", device_type) for device_type in TORCH_OP_TABLES
}


def _check_available(device_type: str) -> None:
    try:
        available = torch.amp.is_autocast_available(device_type)
        reason = ""
    except RuntimeError as error:  # not a device type torch knows at all
        available, reason = False, f" ({error})"
    if not available:
        raise RuntimeError(
            f"User specified an unsupported autocast device_type '{device_type}'{reason}. "
            "Autocast is available for device types such as 'cpu' and 'cuda' (those "
            "torch.amp.is_autocast_available() accepts)."
        )


class autocast:
    """A region in which each op runs in the precision the policy gives it.

    A drop-in for :class:`torch.autocast`: same arguments, defaults, nesting and
    thread-local state (``torch.is_autocast_enabled()`` is true inside), and with the
    default policy bitwise identical results. Ops the policy lists as low precision
    (matmul, conv, linear, ...) run in ``dtype``; float32-listed ops run in float32;
    promote-listed ops run at the widest input type; all others run on the dtypes they
    receive. Only floating tensors on ``device_type`` are cast; float64 never is.

    Args:
        device_type: ``"cpu"`` or ``"cuda"`` (other types torch supports run torch's
            own autocast with no amped policy).
        dtype: the low dtype, ``torch.bfloat16`` or ``torch.float16``; by default
            ``torch.get_autocast_dtype(device_type)`` (bfloat16 on CPU, float16 on CUDA).
        enabled: False makes the region a no-op, as in torch.
        cache_enabled: cache low-precision copies of the weights for the outermost
            region (default: torch's current setting, normally True).
        policy: an :class:`amped.Policy`, a preset name (``"torch"``, ``"strict"``), or
            None for ``"torch"``.

    Raises:
        ValueError: ``device_type`` is not a string, or the policy is for another device.
        RuntimeError: torch has no autocast for ``device_type``.

    Example:
        >>> import torch, amped
        >>> a, b = torch.rand(8, 8), torch.rand(8, 8)
        >>> with amped.autocast("cpu"):
        ...     torch.mm(a, b).dtype, torch.add(a, b).dtype
        (torch.bfloat16, torch.float32)
    """

    def __init__(
        self,
        device_type: str,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
        *,
        policy: Policy | str | None = None,
    ) -> None:
        if not isinstance(device_type, str):
            raise ValueError(f"Expected `device_type` of type `str`, got: `{type(device_type)}`")
        _check_available(device_type)
        self.device = device_type
        self.fast_dtype = torch.get_autocast_dtype(device_type) if dtype is None else dtype
        self._cache_enabled = (
            torch.is_autocast_cache_enabled() if cache_enabled is None else cache_enabled
        )
        self.policy = _resolve_policy(policy, device_type)
        self._enabled = enabled and self._dtype_usable()
        self._open: list[Region] = []  # this object's open regions (recursion)

    def _dtype_usable(self) -> bool:
        if self.device == "cuda":
            if torch_compat.amp_definitely_not_available():
                warnings.warn(
                    "CUDA is not available or torch_xla is imported. Disabling autocast.",
                    stacklevel=3,
                )
                return False
            if self.fast_dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
                raise RuntimeError(
                    "Current CUDA Device does not support bfloat16. Please switch dtype to float16."
                )
            return True
        if self.fast_dtype not in _SUPPORTED_DTYPES:
            name = self.device.upper()
            warnings.warn(
                f"In {name} autocast, but the target dtype is not supported. Disabling "
                f"autocast.\n{name} Autocast only supports dtypes of "
                + ", ".join(map(str, _SUPPORTED_DTYPES))
                + " currently.",
                stacklevel=3,
            )
            return False
        return True

    @property
    def enabled(self) -> bool:
        return self._enabled

    def __enter__(self) -> autocast:
        region = Region(
            self.device,
            self.policy if self._enabled else None,
            self._enabled,
            self.fast_dtype,
            self._cache_enabled,
        )
        engine.enter(region)
        self._open.append(region)
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if not self._open:
            raise RuntimeError(
                "amped.autocast.__exit__ was called more times than __enter__ on this "
                "region object. Use it as `with amped.autocast(...):` or as a decorator."
            )
        engine.exit(self._open.pop())

    def __call__(self, func: F) -> F:
        if not callable(func):
            raise TypeError(
                f"autocast()(func) requires a callable, but got {type(func).__name__}. "
                "Did you mean to use autocast as a context manager? For example:\n"
                "    with amped.autocast(device_type=...):\n"
                "        output = model(input)"
            )

        @functools.wraps(func)
        def decorate_autocast(*args: Any, **kwargs: Any) -> Any:
            with self:
                return func(*args, **kwargs)

        return decorate_autocast  # type: ignore[return-value]

    def __repr__(self) -> str:
        path = f", path={self._open[-1].path.value}" if self._open else ""
        return (
            f"amped.autocast({self.device!r}, dtype={self.fast_dtype}, enabled={self._enabled}, "
            f"cache_enabled={self._cache_enabled}, policy={self.policy!r}{path})"
        )
