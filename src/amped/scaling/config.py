"""The scaler's settings: checked on the way in, with the reason for each bound.

:class:`StrategyConfig` is the immutable value behind the keyword-only strategy
arguments of :class:`amped.GradScaler`; it round-trips through ``state_dict``.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping

import torch

from amped.scaling.checks import (
    SCALE_FLOOR,
    check_bool,
    check_floor,
    check_int,
    check_real,
    check_scale_bound,
    received,
)
from amped.scaling.strategies import ScaleStrategy, make_strategy

__all__ = [
    "StrategyConfig",
    "check_backoff_factor",
    "check_growth_factor",
    "check_growth_interval",
    "check_loaded_scale",
    "check_new_scale",
    "check_scale",
]


_SCALE_RULE = (
    "The loss is multiplied by the scale and the gradients divided by it, so it must be "
    f"finite and at least {SCALE_FLOOR!r} (2**-126; torch's default is 65536.0)."
)


def check_scale(name: str, value: object) -> float:
    """A scale: finite and >= :data:`SCALE_FLOOR` (the loss is multiplied by it, the
    gradients divided)."""
    return check_floor(
        name, check_real(name, value, low=0.0, high=math.inf, rule=_SCALE_RULE), _SCALE_RULE
    )


def check_loaded_scale(value: object) -> float:
    """The scale of a state dict: as :func:`check_scale`, except that a scale in
    ``[0, SCALE_FLOOR)`` (which torch's GradScaler, and amped before the floor, reach
    after ~166 overflows in a row) loads as the floor, with a warning, so such a run can
    resume."""
    real = isinstance(value, (int, float)) and not isinstance(value, bool)
    if real and 0.0 <= value < SCALE_FLOOR:  # type: ignore[operator]
        warnings.warn(
            f"The checkpoint's loss scale {value!r} is below amped's scale floor "
            f"{SCALE_FLOOR!r} (its reciprocal overflows float32); it loads as the floor.",
            RuntimeWarning,
            stacklevel=3,
        )
        return SCALE_FLOOR
    return check_scale("scale", value)


def check_growth_factor(value: object) -> float:
    return check_real(
        "growth_factor",
        value,
        low=1.0,
        high=math.inf,
        rule="The scale is multiplied by it after `growth_interval` clean iterations, so it "
        "must be finite and > 1.0 (default 2.0). For a fixed scale pass dynamic=False.",
    )


def check_backoff_factor(value: object) -> float:
    return check_real(
        "backoff_factor",
        value,
        low=0.0,
        high=1.0,
        rule="The scale is multiplied by it after an overflow, so it must lie strictly "
        "between 0.0 and 1.0 (default 0.5).",
    )


def check_growth_interval(value: object) -> int:
    return check_int(
        "growth_interval",
        value,
        minimum=1,
        rule="It counts the clean iterations in a row before the scale grows (default 2000).",
    )


def check_new_scale(value: object, device_type: str) -> float | torch.Tensor:
    """``update(new_scale=...)``: a float, or a 1-element float tensor without grad.

    A tensor's value is not checked, since reading it would sync with the device.
    """
    if isinstance(value, torch.Tensor):
        rule = (
            f"new_scale must be a float or a 1-element floating tensor on {device_type!r} "
            "with requires_grad=False."
        )
        if value.device.type != device_type or value.numel() != 1 or value.requires_grad:
            raise ValueError(f"{rule} {received('new_scale', value)}")
        if not value.is_floating_point():
            raise TypeError(f"{rule} {received('new_scale', value)}")
        return value.detach().reshape(())
    return check_scale("new_scale", value)


@dataclasses.dataclass(frozen=True)
class StrategyConfig:
    """The strategy arguments of a scaler, checked (see :meth:`checked`)."""

    dynamic: bool = True
    hysteresis: int = 1
    min_scale: float | None = None
    max_scale: float | None = None

    @classmethod
    def checked(
        cls,
        dynamic: object,
        hysteresis: object,
        min_scale: object,
        max_scale: object,
        init_scale: float | None,
    ) -> StrategyConfig:
        """Check the arguments alone and together; ``init_scale``, unless None, must lie
        in the bounds."""
        config = cls(
            check_bool("dynamic", dynamic),
            check_int(
                "hysteresis",
                hysteresis,
                minimum=1,
                rule="The scale backs off on the `hysteresis`-th overflow in a row; 1 is "
                "torch's rule, 2 tolerates one (DeepSpeed's and Megatron's default).",
            ),
            check_scale_bound("min_scale", min_scale),
            check_scale_bound("max_scale", max_scale),
        )
        config._check_together(init_scale)
        return config

    def _check_together(self, init_scale: float | None) -> None:
        low, high = self.min_scale, self.max_scale
        if not self.dynamic and (self.hysteresis != 1 or low is not None or high is not None):
            raise ValueError(
                "With dynamic=False the scale never moves, so hysteresis, min_scale and "
                "max_scale would do nothing; drop them or pass dynamic=True. Received: "
                f"dynamic=False, hysteresis={self.hysteresis!r}, min_scale={low!r}, "
                f"max_scale={high!r}"
            )
        if low is not None and high is not None and low > high:
            raise ValueError(
                f"min_scale must not exceed max_scale. Received: min_scale={low!r}, "
                f"max_scale={high!r}"
            )
        if init_scale is None:
            return
        if (low is not None and init_scale < low) or (high is not None and init_scale > high):
            raise ValueError(
                "init_scale must lie within [min_scale, max_scale]. Received: "
                f"init_scale={init_scale!r}, min_scale={low!r}, max_scale={high!r}"
            )

    def build(self) -> ScaleStrategy:
        return make_strategy(
            dynamic=self.dynamic,
            hysteresis=self.hysteresis,
            min_scale=self.min_scale,
            max_scale=self.max_scale,
        )

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, object]) -> StrategyConfig:
        """Read back :meth:`to_dict`. The checkpoint's scale is not held to the bounds:
        ``update(new_scale=...)`` may have set it outside them on purpose."""
        missing = {field.name for field in dataclasses.fields(cls)} - set(values)
        if missing:
            raise ValueError(
                f"The 'amped' entry of this GradScaler state_dict lacks {sorted(missing)}; "
                f"it was not written by amped.GradScaler.state_dict(). {received('amped', values)}"
            )
        return cls.checked(
            values["dynamic"],
            values["hysteresis"],
            values["min_scale"],
            values["max_scale"],
            None,
        )
