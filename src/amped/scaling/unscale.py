"""Unscale an optimizer's gradients and look for inf/NaN, on the device, without syncs.

Gradients are grouped by device and dtype and each group goes through one call of
torch's fused kernel, which multiplies them by the inverse scale and sets ``found_inf``
to 1.0 if any element is inf or NaN. Nothing here reads a tensor's value on the host.
DTensor gradients (FSDP2, tensor parallel) are checked through their local shards;
:mod:`amped.scaling.distributed` makes the ranks agree.
"""

from __future__ import annotations

import torch

from amped._internal.torch_compat import (
    amp_unscale_and_check_,
    dtensor_class,
    foreach_zero_count,
    sparse_values,
)

__all__ = ["FP16_GRADS_MESSAGE", "PerDevice", "combine_on", "unscale_grads_"]

# torch's wording, first, so code that matches on it keeps working.
FP16_GRADS_MESSAGE = (
    "Attempting to unscale FP16 gradients. GradScaler unscales float32 gradients of "
    "float32 parameters (autocast keeps parameters in float32); keep float16 master "
    "weights out of the optimizer, or use a bfloat16 recipe, which needs no scaling."
)


class PerDevice:
    """A tensor, and its copies on the other devices that ask for it (made once each)."""

    def __init__(self, master: torch.Tensor) -> None:
        self.master = master
        self.copies: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device) -> torch.Tensor:
        tensor = self.copies.get(device)
        if tensor is None:
            if device == self.master.device:
                tensor = self.master
            else:
                tensor = self.master.to(device=device, non_blocking=True, copy=True)
            self.copies[device] = tensor
        return tensor


def group_grads(
    optimizer: torch.optim.Optimizer, *, allow_fp16: bool
) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """The optimizer's gradients (values of sparse ones, local shards of DTensors) by
    (device, dtype).

    Raises:
        ValueError: a float16 gradient, unless ``allow_fp16``.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    dtensor = dtensor_class()
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            if dtensor is not None and isinstance(grad, dtensor):
                grad = grad.to_local()  # a view: unscaling it unscales the DTensor
            if not allow_fp16 and grad.dtype == torch.float16:
                raise ValueError(FP16_GRADS_MESSAGE)
            if grad.is_sparse:
                # Duplicate indices' float16 values may overflow only once summed: check
                # the coalesced values, as torch does.
                if grad.dtype is torch.float16:
                    grad = param.grad = grad.coalesce()
                grad = sparse_values(grad)
            key = (grad.device, grad.dtype)
            bucket = groups.get(key)
            if bucket is None:
                groups[key] = [grad]
            else:
                bucket.append(grad)
    return groups


def unscale_grads_(
    optimizer: torch.optim.Optimizer,
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    *,
    allow_fp16: bool,
    zero_counts: list[tuple[torch.Tensor, int]] | None = None,
) -> dict[torch.device, torch.Tensor]:
    """Multiply the optimizer's gradients by ``inv_scale`` in place and flag inf/NaN.

    Args:
        optimizer: whose ``param_groups`` hold the gradients.
        inv_scale: float32, 0-d: the reciprocal of the scale.
        found_inf: float32, 0-d zero; set to 1.0 where a gradient on its device holds
            an inf or NaN. Copied to each other device that has gradients.
        zero_counts: if given, gets one pair per (device, dtype) group: how many of
            its gradients are zero in every element after unscaling (an int64 0-d
            tensor), and how many gradients it has (the stall check).

    Returns:
        The ``found_inf`` tensor of each device that had gradients (empty if none had).
    """
    inv = PerDevice(inv_scale)
    found = PerDevice(found_inf)
    with torch.no_grad():
        for (device, _), grads in group_grads(optimizer, allow_fp16=allow_fp16).items():
            amp_unscale_and_check_(grads, found.get(device), inv.get(device))
            if zero_counts is not None:
                zero_counts.append((foreach_zero_count(grads), len(grads)))
    return found.copies


def combine_on(device: torch.device, flags: list[torch.Tensor]) -> torch.Tensor:
    """Sum per-device ``found_inf`` flags onto ``device``, without a sync.

    A single flag already there is returned as is. The sum is nonzero exactly when
    one of the flags is (they are 0.0 or 1.0).
    """
    if len(flags) == 1 and flags[0].device == device:
        return flags[0]
    if not flags:
        return torch.zeros((), dtype=torch.float32, device=device)
    total = flags[0].to(device=device, non_blocking=True)
    for flag in flags[1:]:
        total = total + flag.to(device=device, non_blocking=True)
    return total
