"""The one home for calls into torch's private APIs, and for torch-version checks.

torch's private names (``torch._C``, ``torch._dynamo``, ``torch.utils._pytree``,
``torch.amp.grad_scaler._...``) change between releases without notice. Every use of
one in amped goes through a small named function here, with a line saying why it is
needed, so that supporting a new torch release means reading this file only.
Sections are per layer; a layer adds wrappers in its own section.
"""

from __future__ import annotations

import re
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

# --- autocast_mode ---

# --- scaling ---

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


# --- recipes ---

BATCH_NORM_BASE: type[torch.nn.Module] = torch.nn.modules.batchnorm._NormBase
"""The common base of BatchNorm*, SyncBatchNorm and InstanceNorm*: private, no public name."""


def init_optimizer_hooks(optimizer: torch.optim.Optimizer) -> None:
    """Give an optimizer that shares another's param groups torch's hook tables and step
    profiling wrapper: ``Optimizer.__setstate__({})`` sets up just those."""
    torch.optim.Optimizer.__setstate__(optimizer, {})


# --- doctor ---

# --- integrations ---


def steps_with_amp_scaling(optimizer: object) -> bool:
    """Whether ``optimizer.step()`` unscales the gradients itself (torch's fused optimizers
    say so with the private ``_step_supports_amp_scaling``)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


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
