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

__all__ = [
    "TORCH_VERSION",
    "foreach_add_",
    "foreach_copy_",
    "torch_at_least",
]

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


def steps_with_amp_scaling(optimizer: object) -> bool:
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


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    use_fast_accum: bool,
) -> torch.Tensor:
    """torch's FP8 GEMM kernel: private (``torch._scaled_mm``), with no public equivalent."""
    return torch._scaled_mm(
        a,
        b,
        scale_a=scale_a,
        scale_b=scale_b,
        out_dtype=out_dtype,
        use_fast_accum=use_fast_accum,
    )


def cpu_scaled_mm_takes_rowwise() -> bool:
    """Whether torch's CPU ``_scaled_mm`` takes row-wise scales (from 2.12; before, only
    one scale per operand)."""
    return torch_at_least(2, 12)


# --- recipes ---
# torch's multi-tensor ops (what torch.optim's foreach paths use; public in effect but
# underscore-named): one call copies or adds a list of tensors, where a Python loop
# would pay a dispatch per tensor. The compensated optimizers move their chunks with them.


def foreach_copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``d.copy_(s)`` for each pair (casting as ``copy_`` does)."""
    torch._foreach_copy_(dst, src)


def foreach_add_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``d.add_(s)`` for each pair."""
    torch._foreach_add_(dst, src)


BATCH_NORM_BASE: type[torch.nn.Module] = torch.nn.modules.batchnorm._NormBase
"""The common base of BatchNorm*, SyncBatchNorm and InstanceNorm*: private, no public name."""


def init_optimizer_hooks(optimizer: torch.optim.Optimizer) -> None:
    """Give an optimizer that shares another's param groups torch's hook tables and step
    profiling wrapper: ``Optimizer.__setstate__({})`` sets up just those."""
    torch.optim.Optimizer.__setstate__(optimizer, {})


# --- doctor ---

# --- integrations ---

# steps_with_amp_scaling: see the scaling section.


def track_step_for_scheduler(
    optimizer: torch.optim.Optimizer, replaces: torch.optim.Optimizer
) -> None:
    """Wrap ``optimizer.step`` as torch's LR schedulers do (once), for an optimizer swapped
    in under a scheduler: they read the private marks to warn of a scheduler stepped first.
    It counts as stepped if the optimizer it ``replaces`` had."""
    step = optimizer.step
    if not hasattr(step, "_wrapped_by_lr_sched"):

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            optimizer._opt_called = True  # type: ignore[attr-defined]
            return step(*args, **kwargs)

        wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        optimizer.step = wrapper  # type: ignore[method-assign]
        optimizer._opt_called = getattr(replaces, "_opt_called", False)  # type: ignore[attr-defined]


# --- cli ---
