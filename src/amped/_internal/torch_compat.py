"""The one home for calls into torch's private APIs, and for torch-version checks.

torch's private names (``torch._C``, ``torch._dynamo``, ``torch.utils._pytree``,
``torch.amp.grad_scaler._...``) change between releases without notice. Every use of
one in amped goes through a small named function here, with a line saying why it is
needed, so that supporting a new torch release means reading this file only.
Sections are per layer; a layer adds wrappers in its own section.
"""

from __future__ import annotations

import re
import sys
from typing import Any

import torch

__all__ = ["TORCH_VERSION", "torch_at_least"]

# --- compat ---


def _parse_version(text: str) -> tuple[int, int, int]:
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)``; pre-release and local parts are ignored."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if match is None:
        raise ValueError(f"cannot read a torch version from {text!r}")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


TORCH_VERSION: tuple[int, int, int] = _parse_version(torch.__version__)
"""The installed torch's ``(major, minor, patch)``."""


def torch_at_least(major: int, minor: int, patch: int = 0) -> bool:
    """Whether the installed torch is at least ``major.minor.patch``."""
    return (major, minor, patch) <= TORCH_VERSION


# --- policy ---


def aten_op_names() -> list[str]:
    """Every registered op's qualified name (``"aten::mm.out"``, ...): torch lists them
    only through the dispatcher's private API."""
    return list(torch._C._dispatch_get_all_op_names())


def has_kernel_for(qualified_name: str, dispatch_key: str) -> bool:
    """Whether ``qualified_name`` has a kernel for ``dispatch_key`` (e.g. ``"AutocastCPU"``):
    how the installed torch's autocast lists are read, since they live in C++."""
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(qualified_name, dispatch_key))


# --- autocast_mode ---

# --- scaling ---


def amp_update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
) -> None:
    """torch's own kernel for its dynamic loss-scale rule, so the default is bitwise torch's."""
    torch._amp_update_scale_(
        scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval
    )


def amp_unscale_and_check_(
    grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> None:
    """torch's fused multiply-by-``inv_scale`` and inf/NaN check (sets ``found_inf`` to 1.0),
    one launch for a list of same-device, same-dtype tensors."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def sparse_values(tensor: torch.Tensor) -> torch.Tensor:
    """The values of a sparse tensor, coalesced or not (``values()`` refuses uncoalesced)."""
    return tensor._values()


def steps_with_amp_scaling(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer unscales and skips inside its own step (torch's fused and
    capturable ones declare it with this private flag)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def dtensor_class() -> Any:
    """DTensor's class if its module is loaded, else None (no tensor can be one then).

    Looked up, never imported (importing it takes a second); its home was
    ``torch.distributed._tensor`` before torch 2.5.
    """
    for name in ("torch.distributed.tensor", "torch.distributed._tensor"):
        dtensor = getattr(sys.modules.get(name), "DTensor", None)
        if dtensor is not None:
            return dtensor
    return None


def process_group_device_types(group: torch.distributed.ProcessGroup) -> list[str]:
    """The device types a process group's backends communicate on (what
    ``all_gather_object`` reads to place its tensors)."""
    return [device.type for device in group._device_types]


def tensor_use_count(tensor: torch.Tensor) -> int:
    """How many references hold ``tensor``'s C++ object (its Python object counts as one;
    autograd, a pending collective or a C++ container add theirs). torch >= 2.3."""
    return int(tensor._use_count())  # type: ignore[attr-defined]


# --- fp8 ---

# --- recipes ---

# --- doctor ---

# --- integrations ---

# --- cli ---
