"""Delayed scaling state: per-tensor amax histories and scales, updated once per step.

Each Float8 linear layer under delayed scaling holds three float32 buffers (so they
are in ``state_dict`` and a resumed run continues bitwise):

- ``fp8_amax_history`` ``[3, history_len]``: past amaxes of input, weight and
  grad_output, most recent first;
- ``fp8_scale`` ``[3]``: the scales the next step casts with;
- ``fp8_updates``: how many updates have run (0: the first step scales just in time).

During a step the layer records the largest amax it saw per tensor (over every call,
so gradient accumulation and recomputation are covered). :func:`update_delayed_scaling`
then reduces those amaxes over all ranks in **one** all-reduce for the whole model,
pushes them into the histories and computes the next scales (rule in
:class:`~amped.lowp.float8.config.DelayedScaling`), so every rank casts with the same scales.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from amped.lowp.float8.cast import EPS
from amped.lowp.float8.config import DelayedScaling

__all__ = [
    "GRAD_OUTPUT",
    "INPUT",
    "WEIGHT",
    "next_scale",
    "propagate_nonfinite",
    "reduce_max",
    "update_delayed_scaling",
]

INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2
"""Rows of the history and entries of the scale, by tensor."""


# float32's smallest normal: the lowest scale, so 1/scale stays finite.
SCALE_MIN = 2.0**-126


def next_scale(
    amax: torch.Tensor, fp8_max: torch.Tensor, previous: torch.Tensor, margin: int
) -> torch.Tensor:
    """``fp8_max / max(amax, EPS) / 2**margin`` (float64, rounded once to float32) where
    ``0 < amax < inf``, else ``previous``; clamped to ``[2**-126, fp8_max / EPS]``.

    The amax clamp is the dynamic path's (:func:`~amped.lowp.float8.cast.amax_to_scale`): an
    amax of 1e-40 would otherwise make the scale inf, and every later step NaN.
    """
    wide = amax.to(torch.float64).clamp(min=EPS)
    fresh = (fp8_max.to(torch.float64) / wide / 2.0**margin).to(torch.float32)
    fresh = torch.minimum(fresh.clamp(min=SCALE_MIN), fp8_max / EPS)
    usable = (amax > 0) & torch.isfinite(amax)
    return torch.where(usable, fresh, previous)


def propagate_nonfinite(scale: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """``scale``, or NaN where ``amax`` is inf or NaN (bitwise ``scale`` otherwise).

    A delayed scale is finite whatever this tensor holds, and the saturating cast would
    turn an inf into the FP8 maximum: the step would look clean. A NaN scale makes the
    cast NaN, as the dynamic path's scale of 0 does (inf * 0).
    """
    return scale * (amax * 0 + 1)


def reduce_max(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-reduce ``tensor`` in place with MAX when a process group of several ranks is up."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


@torch.no_grad()
def update_delayed_scaling(
    layers: Sequence[torch.nn.Module], group: dist.ProcessGroup | None = None
) -> None:
    """Push this step's amaxes into every layer's history and compute the next scales.

    Call once per optimizer step, on every rank (``TrainSetup.step`` does). One
    all-reduce over ``group`` (default: the world) for all layers together; no host sync.
    """
    # Float8Linear (not imported: it imports this module); Any keeps its buffers typed loosely.
    delayed: list[Any] = [
        layer for layer in layers if getattr(layer, "fp8_delayed", None) is not None
    ]
    if not delayed:
        return
    pending = torch.stack([layer.fp8_pending for layer in delayed])
    reduce_max(pending, group)
    for layer, amax_now in zip(delayed, pending, strict=True):
        rule: DelayedScaling = layer.fp8_delayed
        history = layer.fp8_amax_history
        history.copy_(torch.roll(history, 1, dims=1))
        history[:, 0] = amax_now
        amax = history.amax(dim=1) if rule.amax_compute == "max" else history[:, 0]
        layer.fp8_scale.copy_(next_scale(amax, layer.fp8_max, layer.fp8_scale, rule.margin))
        layer.fp8_updates.add_(1)
        layer.fp8_pending.zero_()
        layer.fp8_started = True
