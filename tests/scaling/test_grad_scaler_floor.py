"""The scale floor: no run of overflows, and no argument, makes 1/scale overflow.

torch's GradScaler (and amped's before the floor) halves the scale on every overflow;
after ~166 in a row from 65536 it is exactly 0.0, and the next clean step multiplies
finite zero gradients by 1/0 = inf, so every parameter becomes NaN. amped floors the
scale at SCALE_FLOOR (2**-126), refuses arguments below it, and loads old state dicts
that fell under it as the floor.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import amped
from amped.scaling.checks import SCALE_FLOOR

STRATEGIES = {
    "default": {},
    "growth_interval-1": dict(growth_interval=1),
    "backoff-0.1": dict(backoff_factor=0.1),
    "hysteresis-2": dict(hysteresis=2),
    "hysteresis-3-min": dict(hysteresis=3, min_scale=SCALE_FLOOR),
    "min_scale": dict(min_scale=1.0),
    "max_scale": dict(max_scale=2.0**20),
    "static": dict(dynamic=False),
    "static-tiny": dict(dynamic=False, init_scale=SCALE_FLOOR),
}


def _step(scaler, param: torch.Tensor, optimizer, overflow: bool) -> None:
    optimizer.zero_grad()
    loss = ((param - 1.0) ** 2).sum() * (math.inf if overflow else 1.0)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def _round_trip(scaler, kwargs: dict) -> None:
    state = scaler.state_dict()
    copy = amped.GradScaler("cpu", **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # amped's own state needs no flooring
        copy.load_state_dict(state)
    assert copy.state_dict() == state


@pytest.mark.parametrize("kwargs", STRATEGIES.values(), ids=STRATEGIES.keys())
def test_thousand_overflows_then_clean_steps_stay_finite(kwargs: dict) -> None:
    scaler = amped.GradScaler("cpu", **kwargs)
    param = torch.zeros(3, requires_grad=True)
    optimizer = torch.optim.SGD([param], lr=0.1)
    lowest = math.inf
    for step in range(1000):
        _step(scaler, param, optimizer, overflow=True)
        scale = scaler.get_scale()
        lowest = min(lowest, scale)
        assert scale >= SCALE_FLOOR and math.isfinite(scale), (step, scale)
        assert torch.equal(param.detach(), torch.zeros(3)), step  # every step skipped
        if step % 25 == 0 or scale == SCALE_FLOOR:
            _round_trip(scaler, kwargs)
    if kwargs.get("dynamic", True) and "min_scale" not in kwargs:
        assert lowest == SCALE_FLOOR  # the run did reach the floor, and stayed on it
    for step in range(30):
        _step(scaler, param, optimizer, overflow=False)
        assert torch.isfinite(param).all(), step
        _round_trip(scaler, kwargs)
    # The clean steps were taken, not skipped: the parameters moved towards 1.
    assert (param.detach() > 0.5).all()


def test_torch_reaches_zero_and_nan_where_amped_floors() -> None:
    """The control: the same run through torch's GradScaler ends in NaN parameters."""
    scaler = torch.amp.GradScaler("cpu")
    param = torch.zeros(3, requires_grad=True)
    optimizer = torch.optim.SGD([param], lr=0.1)
    for _ in range(200):
        _step(scaler, param, optimizer, overflow=True)
    assert scaler.get_scale() == 0.0
    _step(scaler, param, optimizer, overflow=False)
    assert torch.isnan(param).all()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(init_scale=1e-39),
        dict(init_scale=SCALE_FLOOR / 2),
        dict(min_scale=2.8e-39, init_scale=1.0),
        dict(max_scale=1e-40, init_scale=1e-40),
    ],
    ids=["init-1e-39", "init-half-floor", "min-2.8e-39", "max-1e-40"],
)
def test_arguments_below_the_floor_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=r"scale floor 1\.1754943508222875e-38 \(2\*\*-126\)"):
        amped.GradScaler("cpu", **kwargs)


def test_the_floor_itself_is_allowed_and_exact() -> None:
    assert SCALE_FLOOR == 2.0**-126
    scaler = amped.GradScaler("cpu", init_scale=SCALE_FLOOR, min_scale=SCALE_FLOOR)
    assert scaler.get_scale() == SCALE_FLOOR


def test_new_scale_below_the_floor() -> None:
    scaler = amped.GradScaler("cpu")
    param = torch.zeros(3, requires_grad=True)
    optimizer = torch.optim.SGD([param], lr=0.1)
    _step(scaler, param, optimizer, overflow=False)
    scaler.scale(param.sum()).backward()
    scaler.step(optimizer)
    with pytest.raises(ValueError, match="scale floor"):
        scaler.update(new_scale=1e-40)
    # A tensor's value is not read on the host (no sync): it is floored on the device.
    scaler.update(new_scale=torch.tensor(0.0))
    assert scaler.get_scale() == SCALE_FLOOR


@pytest.mark.parametrize("value", [0.0, 1e-45, 2.0**-149])
def test_state_below_the_floor_loads_as_the_floor(value: float) -> None:
    """torch's state dict after its scale collapsed (or amped's before the floor) resumes."""
    state = torch.amp.GradScaler("cpu").state_dict() | {"scale": value}
    scaler = amped.GradScaler("cpu")
    with pytest.warns(RuntimeWarning, match="loads as the floor"):
        scaler.load_state_dict(state)
    assert scaler.get_scale() == SCALE_FLOOR


@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf])
def test_state_with_a_bad_scale_is_still_refused(value: float) -> None:
    state = torch.amp.GradScaler("cpu").state_dict() | {"scale": value}
    with pytest.raises(ValueError, match="scale"):
        amped.GradScaler("cpu").load_state_dict(state)
