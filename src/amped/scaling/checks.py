"""The scaler's arguments, checked on the way in, with the reason for each bound.

``TypeError`` for a wrong type, ``ValueError`` for a wrong value, each message ending
with ``Received: name=value (of type T)``; call-order errors are raised where the
order is known, as :class:`ScalerOrderError`.
"""

from __future__ import annotations

import math
import numbers
import warnings

import torch

from amped._internal.errors import type_error, value_error

__all__ = [
    "SCALE_FLOOR",
    "ScalerOrderError",
    "ScalerStateDictError",
    "check_bool",
    "check_device_type",
    "check_factor",
    "check_growth_interval",
    "check_int",
    "check_loaded_scale",
    "check_new_scale",
    "check_real",
    "check_scale",
    "check_scale_bound",
]


# float32's smallest normal number, 2**-126: below it 1/scale overflows float32, and at
# 0.0 a clean step turns every parameter into NaN (see docs/robustness.md).
SCALE_FLOOR = float(torch.finfo(torch.float32).tiny)

_SCALE_RULE = (
    "The loss is multiplied by the scale and the gradients divided by it, so it must be "
    f"finite and at least {SCALE_FLOOR!r} (2**-126; torch's default is 65536.0)."
)
_BOUND_RULE = (
    f"A scale bound is None (unbounded) or a finite number >= {SCALE_FLOOR!r} (2**-126; "
    "below it the reciprocal of the scale overflows float32)."
)
# (exclusive low, exclusive high, why) of torch's two factors of the dynamic rule.
_FACTOR_RULES = {
    "growth_factor": (
        1.0,
        math.inf,
        "The scale is multiplied by it after `growth_interval` clean iterations, so it "
        "must be finite and > 1.0 (default 2.0). For a fixed scale pass dynamic=False.",
    ),
    "backoff_factor": (
        0.0,
        1.0,
        "The scale is multiplied by it after an overflow, so it must lie strictly "
        "between 0.0 and 1.0 (default 0.5).",
    ),
}


class ScalerOrderError(RuntimeError, AssertionError):
    """A scaler method called out of order (before ``scale()``, ``update()`` before any
    ``step()``, pickling mid-iteration).

    Also an ``AssertionError``, which ``torch.amp.GradScaler`` raises in these cases, so
    code written against torch that catches it keeps working.
    """


class ScalerStateDictError(ValueError, KeyError):
    """A state dict that lacks torch's GradScaler keys: a ``ValueError``, and a ``KeyError``
    as torch raises for it."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def check_real(name: str, value: object, *, low: float, high: float, rule: str) -> float:
    """Return ``value`` as a float if it is a finite real number strictly inside (low, high).

    ``rule`` says in one sentence why the bounds are what they are.
    """
    # bool is an int to Python; a scale of True is a bug, not a number.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise type_error(f"`{name}` must be a real number. {rule}", name, value)
    number = float(value)
    if not (math.isfinite(number) and low < number < high):
        raise value_error(f"`{name}` is out of range. {rule}", name, value)
    return number


def check_int(name: str, value: object, *, minimum: int, rule: str) -> int:
    """Return ``value`` if it is an int (not a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise type_error(f"`{name}` must be an int. {rule}", name, value)
    if value < minimum:
        raise value_error(f"`{name}` must be >= {minimum}. {rule}", name, value)
    return int(value)


def check_bool(name: str, value: object) -> bool:
    """Return ``value`` as a bool; ints 0 and 1 pass (argparse flags often are ints)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    raise type_error(f"`{name}` must be True or False", name, value)


def _check_floor(name: str, number: float, rule: str) -> float:
    if number < SCALE_FLOOR:
        raise value_error(
            f"`{name}` is below amped's scale floor {SCALE_FLOOR!r} (2**-126): gradients are "
            "unscaled by 1/scale, which overflows float32 to inf there and turns zero "
            f"gradients into NaN. {rule}",
            name,
            number,
        )
    return number


def check_scale(name: str, value: object) -> float:
    """A scale: finite and >= :data:`SCALE_FLOOR`."""
    number = check_real(name, value, low=0.0, high=math.inf, rule=_SCALE_RULE)
    return _check_floor(name, number, _SCALE_RULE)


def check_scale_bound(name: str, value: object) -> float | None:
    """A ``min_scale``/``max_scale`` bound: None, or a finite float >= SCALE_FLOOR."""
    if value is None:
        return None
    number = check_real(name, value, low=0.0, high=math.inf, rule=_BOUND_RULE)
    return _check_floor(name, number, _BOUND_RULE)


def check_loaded_scale(value: object) -> float:
    """The scale of a state dict: as :func:`check_scale`, except that one in
    ``[0, SCALE_FLOOR)`` (torch's scaler reaches it after ~166 overflows in a row) loads
    as the floor, with a warning, so such a run can resume."""
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


def check_factor(name: str, value: object) -> float:
    """``growth_factor`` (> 1) or ``backoff_factor`` (in (0, 1)), by ``name``."""
    low, high, rule = _FACTOR_RULES[name]
    return check_real(name, value, low=low, high=high, rule=rule)


def check_growth_interval(value: object) -> int:
    rule = "It counts the clean iterations in a row before the scale grows (default 2000)."
    return check_int("growth_interval", value, minimum=1, rule=rule)


def check_new_scale(value: object, device_type: str) -> float | torch.Tensor:
    """``update(new_scale=...)``: a float, or a 1-element float tensor without grad.

    A tensor's value is not checked, since reading it would sync with the device.
    """
    if not isinstance(value, torch.Tensor):
        return check_scale("new_scale", value)
    rule = (
        f"new_scale must be a float or a 1-element floating tensor on {device_type!r} "
        "with requires_grad=False."
    )
    if value.device.type != device_type or value.numel() != 1 or value.requires_grad:
        raise value_error(rule, "new_scale", value)
    if not value.is_floating_point():
        raise type_error(rule, "new_scale", value)
    return value.detach().reshape(())


def check_device_type(value: object) -> str:
    """Return the device type of a ``device`` argument: ``"cuda"``, ``"cpu"``, ...

    torch takes a string; a :class:`torch.device` is accepted too. Only the type
    matters: the scale lives on the device of the first tensor passed to ``scale()``.
    """
    if isinstance(value, torch.device):
        return value.type
    if not isinstance(value, str):
        raise type_error(
            "`device` must be a device type string such as 'cuda' or 'cpu'", "device", value
        )
    try:
        return torch.device(value).type
    except RuntimeError as error:
        raise value_error(
            f"`device` is not a device torch knows ({error}). Use 'cuda', 'cpu' or another "
            "torch device type",
            "device",
            value,
        ) from None
