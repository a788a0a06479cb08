"""Whether a GradScaler skips a step: the check behind the doctor's loss-scale advice.

The doctor recommends ``amped.GradScaler(device_type, init_scale=S)``; before it says
so, it runs that very scaler through one plain training step (autocast forward,
``scaler.scale(loss).backward()``, ``scaler.step``, ``scaler.update``) on a copy of the
model, with the batch it diagnosed. ``update`` backs the scale off when the step found
an inf/NaN gradient and skipped the optimizer's step, so the step was skipped exactly
when the scale went down.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from amped.autocast_mode import autocast
from amped.policy import Policy
from amped.scaling import GradScaler
from amped.tasks.task import call_model

__all__ = ["scaler_skips"]


def scaler_skips(
    model: torch.nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    device_type: str,
    dtype: torch.dtype,
    policy: Policy | None,
    scale: float,
    seed: int,
) -> bool:
    """Whether ``GradScaler(device_type, init_scale=scale)`` skips the step of ``model``
    on ``inputs`` (a deep copy: the caller's model and RNG are left as they were)."""
    private = copy.deepcopy(model)
    private.zero_grad(set_to_none=True)
    # lr 0: the step's outcome is the scaler's decision alone, not the update's.
    optimizer = torch.optim.SGD(private.parameters(), lr=0.0)
    scaler = GradScaler(device_type, init_scale=scale)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with autocast(device_type, dtype=dtype, policy=policy):
            loss = loss_fn(call_model(private, inputs))
        scaler.scale(loss.float()).backward()
        scaler.step(optimizer)
        scaler.update()
    return scaler.get_scale() < scale
