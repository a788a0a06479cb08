"""Where each optimizer is in the scaler's iteration, and its inf/NaN flags.

torch's stage machine: ``scale`` -> (``unscale_``) -> ``step`` -> ``update``, per
optimizer, so that each call can refuse the wrong order with torch's error. Frameworks
read a stage as torch's dict (``scaler._per_optimizer_states[id(opt)]["stage"]``).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import torch

__all__ = ["OptState", "OptimizerState"]


class OptState(enum.Enum):
    """Where an optimizer is in the iteration: scale -> (unscale_) -> step -> update."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclasses.dataclass
class OptimizerState:
    """Per optimizer, per iteration: its stage and its inf/NaN flag on each device."""

    stage: OptState = OptState.READY
    found_inf_per_device: dict[torch.device, torch.Tensor] = dataclasses.field(default_factory=dict)
    # Per gradient group: how many gradients were zero in every element after
    # unscaling (on the device), and how many it has (the stall check).
    zero_counts: list[tuple[torch.Tensor, int]] = dataclasses.field(default_factory=list)

    def __getitem__(self, key: str) -> Any:
        """Read as torch's per-optimizer dict (frameworks read ``["stage"]``)."""
        if key == "stage":
            return torch.amp.grad_scaler.OptState[self.stage.name]
        if key == "found_inf_per_device":
            return self.found_inf_per_device
        raise KeyError(key)
