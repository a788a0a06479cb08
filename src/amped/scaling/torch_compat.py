"""What training frameworks read of ``torch.amp.GradScaler`` beyond its public API.

Accelerate calls ``scaler._lazy_init_scale_growth_tracker(scaler._device)`` after loading
a checkpoint (FSDP2); Lightning, Accelerate and the transformers Trainer read
``_scale``, ``_enabled``, ``_device`` and ``_growth_tracker`` (attributes every amped
``GradScaler`` has, with torch's types: float32 and int32 0-d tensors once initialised,
a bool, a device-type string) and ``_per_optimizer_states[id(opt)]["stage"]``
(:class:`~amped.scaling.scaler_base.OptimizerState` reads as torch's dict). This mixin
adds the methods amped's scaler lacked, and makes ``state_dict()`` exactly torch's
when nothing amped-only is in use, so a framework that compares or re-creates it
sees torch's layout.
"""

from __future__ import annotations

from typing import Any

import torch

from amped.scaling import config as cfg
from amped.scaling.scaler_base import AMPED_KEY, GradScalerBase
from amped.scaling.unscale import unscale_grads_

__all__ = ["TorchCompatible"]


class TorchCompatible(GradScalerBase):
    """torch's private GradScaler methods that frameworks call, with torch's meaning."""

    def _lazy_init_scale_growth_tracker(self, dev: torch.device | str) -> None:
        """Create the scale and growth tracker on ``dev`` (torch's name for the lazy init
        that ``scale()`` otherwise does on the first loss it sees)."""
        if self._growth_tracker is not None:
            raise RuntimeError("_growth_tracker initialized before _scale")
        self._lazy_init(torch.device(dev))

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        """Multiply ``optimizer``'s gradients by ``inv_scale``; flag inf/NaN per device."""
        return unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16=allow_fp16)

    def _amped_only(self) -> bool:
        """Whether the state holds something torch's layout cannot: a strategy other than
        torch's dynamic one, or a recorded history (whose step numbers need the update
        count)."""
        default = cfg.StrategyConfig.checked(True, 1, None, None, self._init_scale)
        return self._config != default or self._history is not None

    def state_dict(self) -> dict[str, Any]:
        """torch's five entries; plus ``"amped"`` (strategy settings, counters, update
        count) only when an amped-only strategy or history is in use. Empty if disabled.
        Syncs with the device (it reads the scale)."""
        state = super().state_dict()
        if state and not self._amped_only():
            del state[AMPED_KEY]
        return state
