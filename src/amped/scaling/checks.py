"""Argument checks for the scaling layer, with errors in one voice.

Every message says what was wrong and what is allowed, and ends with
``Received: name=value (of type T)``. ``TypeError`` for a wrong type, ``ValueError``
for a wrong value; call-order errors are raised where the order is known.
"""

from __future__ import annotations

import math
import numbers

import torch

__all__ = [
    "SCALE_FLOOR",
    "ScalerOrderError",
    "ScalerStateDictError",
    "check_bool",
    "check_device_type",
    "check_floor",
    "check_int",
    "check_real",
    "check_scale_bound",
    "received",
]


# The smallest scale amped lets exist: float32's smallest normal number, 2**-126.
# Gradients are unscaled by multiplying with the reciprocal of the scale (computed in
# fp64, then rounded to float32). Below about 2.9e-39 that reciprocal overflows to inf,
# and at 0.0 the loss is multiplied to 0, the gradients are all finite zeros, the
# inf/NaN check (which runs before the multiply) passes and 0 * inf = NaN reaches every
# parameter. A power of two, so halving from 65536 lands on it exactly; normal, so no
# flush-to-zero mode turns it into 0.
SCALE_FLOOR = float(torch.finfo(torch.float32).tiny)


class ScalerOrderError(RuntimeError, AssertionError):
    """A scaler method called out of order (before ``scale()``, ``update()`` before any
    ``step()``, pickling mid-iteration).

    A ``RuntimeError``, amped's type for call-order mistakes, and also an
    ``AssertionError``, which is what ``torch.amp.GradScaler`` raises in these cases: code
    written against torch that catches it keeps working.
    """


class ScalerStateDictError(ValueError, KeyError):
    """A state dict that lacks torch's GradScaler keys: a ``ValueError``, and a ``KeyError``
    as torch raises for it."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def received(name: str, value: object) -> str:
    """The closing sentence of every argument error."""
    return f"Received: {name}={value!r} (of type {type(value).__name__})"


def check_real(name: str, value: object, *, low: float, high: float, rule: str) -> float:
    """Return ``value`` as a float if it is a finite real number strictly inside (low, high).

    Args:
        name: the argument's name, as the user wrote it.
        value: what the user passed.
        low: exclusive lower bound.
        high: exclusive upper bound.
        rule: why the bounds are what they are, one sentence.
    """
    # bool is an int to Python; a scale of True is a bug, not a number.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be a real number. {rule} {received(name, value)}")
    number = float(value)
    if not (math.isfinite(number) and low < number < high):
        raise ValueError(f"`{name}` is out of range. {rule} {received(name, value)}")
    return number


def check_int(name: str, value: object, *, minimum: int, rule: str) -> int:
    """Return ``value`` if it is an int (not a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must be an int. {rule} {received(name, value)}")
    if value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}. {rule} {received(name, value)}")
    return int(value)


def check_bool(name: str, value: object) -> bool:
    """Return ``value`` as a bool; ints 0 and 1 pass (argparse flags often are ints)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    raise TypeError(f"`{name}` must be True or False. {received(name, value)}")


def check_scale_bound(name: str, value: object) -> float | None:
    """Return a ``min_scale``/``max_scale`` bound: None, or a finite float >= SCALE_FLOOR."""
    if value is None:
        return None
    rule = (
        f"A scale bound is None (unbounded) or a finite number >= {SCALE_FLOOR!r} (2**-126; "
        "below it the reciprocal of the scale overflows float32)."
    )
    return check_floor(name, check_real(name, value, low=0.0, high=math.inf, rule=rule), rule)


def check_floor(name: str, number: float, rule: str) -> float:
    """Refuse a positive scale below :data:`SCALE_FLOOR` (its reciprocal overflows)."""
    if number < SCALE_FLOOR:
        raise ValueError(
            f"`{name}` is below amped's scale floor {SCALE_FLOOR!r} (2**-126): gradients are "
            "unscaled by 1/scale, which overflows float32 to inf there and turns zero "
            f"gradients into NaN. {rule} {received(name, number)}"
        )
    return number


def check_device_type(value: object) -> str:
    """Return the device type of a ``device`` argument: ``"cuda"``, ``"cpu"``, ...

    torch takes a string; a :class:`torch.device` is accepted too. Only the type
    matters: the scale lives on the device of the first tensor passed to ``scale()``.
    """
    if isinstance(value, torch.device):
        return value.type
    if not isinstance(value, str):
        raise TypeError(
            "`device` must be a device type string such as 'cuda' or 'cpu'. "
            + received("device", value)
        )
    try:
        return torch.device(value).type
    except RuntimeError as error:
        raise ValueError(
            f"`device` is not a device torch knows ({error}). Use 'cuda', 'cpu' or another "
            f"torch device type. {received('device', value)}"
        ) from None
