"""Every documented error: bad constructor arguments, bad values, and call-order misuse."""

from __future__ import annotations

import math
import pickle
import re

import pytest
import torch
from scaler_helpers import BackoffOnly

import amped
from amped.scaling.strategies import Bounded, DynamicScale, Hysteresis, StaticScale

BAD_VALUES = {
    "init_scale-zero": (dict(init_scale=0.0), "init_scale=0.0 (of type float)"),
    "init_scale-negative": (dict(init_scale=-1), "init_scale=-1 (of type int)"),
    "init_scale-inf": (dict(init_scale=math.inf), "init_scale=inf (of type float)"),
    "init_scale-nan": (dict(init_scale=math.nan), "init_scale=nan (of type float)"),
    "growth_factor-one": (dict(growth_factor=1.0), "growth_factor=1.0 "),
    "growth_factor-below-one": (dict(growth_factor=0.5), "growth_factor=0.5 "),
    "growth_factor-inf": (dict(growth_factor=math.inf), "growth_factor=inf "),
    "backoff_factor-one": (dict(backoff_factor=1.0), "backoff_factor=1.0 "),
    "backoff_factor-zero": (dict(backoff_factor=0.0), "backoff_factor=0.0 "),
    "backoff_factor-above-one": (dict(backoff_factor=1.5), "backoff_factor=1.5 "),
    "growth_interval-zero": (dict(growth_interval=0), "growth_interval=0 (of type int)"),
    "growth_interval-negative": (dict(growth_interval=-3), "growth_interval=-3 "),
    "hysteresis-zero": (dict(hysteresis=0), "hysteresis=0 (of type int)"),
    "min_scale-zero": (dict(min_scale=0.0), "min_scale=0.0 "),
    "max_scale-inf": (dict(max_scale=math.inf), "max_scale=inf "),
    "min-above-max": (dict(min_scale=8.0, max_scale=4.0, init_scale=4.0), "min_scale=8.0"),
    "init-below-min": (dict(min_scale=2.0**20), "init_scale=65536.0"),
    "init-above-max": (dict(max_scale=2.0**10), "init_scale=65536.0"),
    "static-with-hysteresis": (dict(dynamic=False, hysteresis=2), "dynamic=False"),
    "static-with-bound": (dict(dynamic=False, max_scale=1e6), "dynamic=False"),
    "device-unknown": (dict(device="gpu0"), "device='gpu0' (of type str)"),
}

BAD_TYPES = {
    "init_scale-str": (dict(init_scale="big"), "init_scale='big' (of type str)"),
    "init_scale-none": (dict(init_scale=None), "init_scale=None (of type NoneType)"),
    "init_scale-bool": (dict(init_scale=True), "init_scale=True (of type bool)"),
    "init_scale-tensor": (dict(init_scale=torch.tensor(2.0)), "(of type Tensor)"),
    "growth_factor-str": (dict(growth_factor="2"), "growth_factor='2' (of type str)"),
    "growth_interval-float": (dict(growth_interval=2.5), "growth_interval=2.5 "),
    "growth_interval-bool": (dict(growth_interval=True), "growth_interval=True "),
    "enabled-str": (dict(enabled="yes"), "enabled='yes' (of type str)"),
    "enabled-two": (dict(enabled=2), "enabled=2 (of type int)"),
    "hysteresis-float": (dict(hysteresis=2.0), "hysteresis=2.0 (of type float)"),
    "min_scale-str": (dict(min_scale="1"), "min_scale='1' (of type str)"),
    "device-int": (dict(device=0), "device=0 (of type int)"),
    "dynamic-str": (dict(dynamic="no"), "dynamic='no' (of type str)"),
    "record_history-none": (dict(record_history=None), "record_history=None "),
}


@pytest.mark.parametrize(("kwargs", "received"), BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_bad_constructor_value_raises_value_error(kwargs, received) -> None:
    kwargs = {"device": "cpu", **kwargs}
    with pytest.raises(ValueError, match="Received: .*" + re.escape(received)):
        amped.GradScaler(**kwargs)


@pytest.mark.parametrize(("kwargs", "received"), BAD_TYPES.values(), ids=BAD_TYPES.keys())
def test_bad_constructor_type_raises_type_error(kwargs, received) -> None:
    kwargs = {"device": "cpu", **kwargs}
    with pytest.raises(TypeError, match="Received: .*" + re.escape(received)):
        amped.GradScaler(**kwargs)


@pytest.mark.parametrize(
    ("setter", "value", "error"),
    [
        ("set_growth_factor", 0.9, ValueError),
        ("set_backoff_factor", 2.0, ValueError),
        ("set_growth_interval", 0, ValueError),
        ("set_growth_interval", 1.5, TypeError),
    ],
    ids=["growth_factor", "backoff_factor", "growth_interval", "growth_interval-type"],
)
def test_bad_setter_value(setter: str, value, error) -> None:
    scaler = amped.GradScaler("cpu")
    with pytest.raises(error, match="Received: "):
        getattr(scaler, setter)(value)


def scaler(**kwargs):
    return lambda: amped.GradScaler("cpu", **kwargs)


# strategy= and the strategy wrappers: (what to call, the error, its message).
BAD_STRATEGIES = {
    "with-static": (scaler(strategy=StaticScale(), dynamic=False), ValueError, "one of the two"),
    "inner-bound-under-keyword-bound": (
        scaler(strategy=Bounded(DynamicScale(), min_scale=2.0**20), max_scale=2.0**30),
        ValueError,
        "init_scale=65536.0",
    ),
    "hysteresis-twice": (
        scaler(strategy=Hysteresis(DynamicScale(), 2), hysteresis=3),
        ValueError,
        "already holds a hysteresis",
    ),
    "static-with-bound": (scaler(strategy=StaticScale(), min_scale=1.0), ValueError, "never moves"),
    "bound-above-own": (
        scaler(strategy=BackoffOnly(), max_scale=1024.0),
        ValueError,
        "init_scale=65536.0",
    ),
    "a-class": (scaler(strategy=DynamicScale), TypeError, r"strategy=DynamicScale\(\)"),
    "a-string": (scaler(strategy="dynamic"), TypeError, "strategy='dynamic' "),
    "init-above-bound": (
        scaler(strategy=Bounded(DynamicScale(), max_scale=1024.0)),
        ValueError,
        "init_scale=65536.0",
    ),
    "bounded-without-bounds": (lambda: Bounded(DynamicScale()), ValueError, "needs `min_scale`"),
    "bounded-below-floor": (lambda: Bounded(DynamicScale(), 0.0), ValueError, "min_scale=0.0"),
    "bounded-min-above-max": (lambda: Bounded(DynamicScale(), 8.0, 4.0), ValueError, "exceed"),
    "bounded-inner-class": (lambda: Bounded(DynamicScale, 1.0), TypeError, "pass an instance"),
    "hysteresis-zero": (lambda: Hysteresis(DynamicScale(), 0), ValueError, "hysteresis=0 "),
    "hysteresis-float": (lambda: Hysteresis(DynamicScale(), 2.0), TypeError, "hysteresis=2.0"),
    "hysteresis-inner-str": (lambda: Hysteresis("dynamic", 2), TypeError, "inner='dynamic'"),
    "counter-clash": (
        lambda: Hysteresis(Hysteresis(DynamicScale(), 2), 3).counters(),
        ValueError,
        "own the counter",
    ),
}


@pytest.mark.parametrize(
    ("make", "error", "message"), BAD_STRATEGIES.values(), ids=BAD_STRATEGIES.keys()
)
def test_bad_strategy_is_refused(make, error, message) -> None:
    with pytest.raises(error, match=message):
        make()


def scaled_iteration(make):
    param = torch.ones(3, requires_grad=True)
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = make("cpu")
    scaler.scale(param.sum()).backward()
    return scaler, optimizer


# Misuse that torch answers with a RuntimeError: amped raises the same, same words.
SHARED_MISUSE = {
    "unscale-twice": (
        lambda s, o: (s.unscale_(o), s.unscale_(o)),
        "unscale_() has already been called on this optimizer since the last update().",
    ),
    "unscale-after-step": (
        lambda s, o: (s.step(o), s.unscale_(o)),
        "unscale_() is being called after step().",
    ),
    "step-twice": (
        lambda s, o: (s.step(o), s.step(o)),
        "step() has already been called since the last update().",
    ),
    "closure-keyword": (
        lambda s, o: s.step(o, closure=lambda: None),
        "Closure use is not currently supported if GradScaler is enabled.",
    ),
}


@pytest.mark.parametrize("make", [amped.GradScaler, torch.amp.GradScaler], ids=["amped", "torch"])
@pytest.mark.parametrize(("misuse", "message"), SHARED_MISUSE.values(), ids=SHARED_MISUSE.keys())
def test_call_order_misuse_raises_like_torch(make, misuse, message) -> None:
    scaler, optimizer = scaled_iteration(make)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        misuse(scaler, optimizer)


def test_positional_closure_is_refused() -> None:
    # torch passes a positional closure through to optimizer.step, which would then
    # compute an unscaled loss; amped refuses it as it refuses closure=.
    scaler, optimizer = scaled_iteration(amped.GradScaler)
    with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
        scaler.step(optimizer, lambda: None)


# torch raises AssertionError for these; amped raises an error that is both a
# RuntimeError (call order) and an AssertionError, so torch-era handlers still catch it.
@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda s, o: s.unscale_(o), r"unscale_\(\) was called before scale\(\)"),
        (lambda s, o: s.step(o), r"step\(\) was called before scale\(\)"),
        (lambda s, o: s.update(), r"update\(\) was called before scale\(\)"),
    ],
    ids=["unscale_", "step", "update"],
)
def test_calls_before_scale(call, message) -> None:
    optimizer = torch.optim.SGD([torch.ones(1, requires_grad=True)], lr=0.1)
    with pytest.raises(RuntimeError, match=message):
        call(amped.GradScaler("cpu"), optimizer)
    with pytest.raises(AssertionError):  # what torch raises here
        call(torch.amp.GradScaler("cpu"), optimizer)
    with pytest.raises(AssertionError, match=message):
        call(amped.GradScaler("cpu"), optimizer)


def test_state_dict_without_torch_keys_is_a_value_and_key_error() -> None:
    with pytest.raises(KeyError):  # what torch raises here
        torch.amp.GradScaler("cpu").load_state_dict({"scale": 1.0})
    with pytest.raises(KeyError) as error:
        amped.GradScaler("cpu").load_state_dict({"scale": 1.0})
    assert isinstance(error.value, ValueError)
    assert str(error.value).startswith("This GradScaler state_dict lacks")


def test_update_without_any_step() -> None:
    scaler, _ = scaled_iteration(amped.GradScaler)
    with pytest.raises(RuntimeError, match="No inf checks were recorded prior to update"):
        scaler.update()
    with pytest.raises(AssertionError, match="No inf checks"):
        scaler.update()


def test_step_of_an_optimizer_without_gradients() -> None:
    scaler, _ = scaled_iteration(amped.GradScaler)
    idle = torch.optim.SGD([torch.ones(1, requires_grad=True)], lr=0.1)
    with pytest.raises(RuntimeError, match="No inf checks were recorded for this optimizer"):
        scaler.step(idle)


@pytest.mark.parametrize("make", [amped.GradScaler, torch.amp.GradScaler], ids=["amped", "torch"])
def test_fp16_gradients_are_refused(make) -> None:
    param = torch.ones(3, dtype=torch.float16, requires_grad=True)
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = make("cpu")
    scaler.scale(param.float().sum()).backward()
    with pytest.raises(ValueError, match=re.escape("Attempting to unscale FP16 gradients.")):
        scaler.step(optimizer)


@pytest.mark.parametrize(
    "outputs", ["loss", [torch.ones(1), 3.0], (torch.ones(1), [None])], ids=["str", "float", "None"]
)
def test_scale_refuses_non_tensors(outputs) -> None:
    with pytest.raises(ValueError, match="outputs must be a Tensor or an iterable of Tensors"):
        amped.GradScaler("cpu").scale(outputs)


@pytest.mark.parametrize(
    ("new_scale", "error"),
    [
        (-1.0, ValueError),
        (math.inf, ValueError),
        ("2", TypeError),
        (torch.ones(2), ValueError),
        (torch.ones(1, requires_grad=True), ValueError),
        (torch.ones(1, dtype=torch.int32), TypeError),
    ],
    ids=["negative", "inf", "str", "two-elements", "requires-grad", "int-tensor"],
)
def test_bad_new_scale(new_scale, error) -> None:
    scaler, optimizer = scaled_iteration(amped.GradScaler)
    scaler.step(optimizer)
    with pytest.raises(error, match="new_scale"):
        scaler.update(new_scale)


def test_pickling_mid_iteration_is_refused() -> None:
    scaler, optimizer = scaled_iteration(amped.GradScaler)
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="may only be pickled at the beginning"):
        pickle.dumps(scaler)


def test_history_needs_record_history() -> None:
    with pytest.raises(RuntimeError, match="record_history=True"):
        _ = amped.GradScaler("cpu").history


def good_state() -> dict:
    return amped.GradScaler("cpu", hysteresis=2).state_dict()


BAD_STATES = {
    "empty": ({}, RuntimeError, "The source state dict is empty"),
    "not-a-dict": ([("scale", 1.0)], TypeError, "state_dict must be a dict"),
    "missing-key": ({"scale": 2.0}, ValueError, "lacks"),
    "negative-scale": ({**good_state(), "scale": -2.0}, ValueError, "scale=-2.0"),
    "str-interval": ({**good_state(), "growth_interval": "9"}, TypeError, "growth_interval='9'"),
    "amped-version": (
        {**good_state(), "amped": {**good_state()["amped"], "version": 99}},
        ValueError,
        "format version",
    ),
    "amped-counters": (
        {**good_state(), "amped": {**good_state()["amped"], "counters": {}}},
        ValueError,
        "holds counters",
    ),
    "amped-strategy": (
        {**good_state(), "amped": {**good_state()["amped"], "strategy": {"dynamic": True}}},
        ValueError,
        "lacks",
    ),
}


@pytest.mark.parametrize(("state", "error", "message"), BAD_STATES.values(), ids=BAD_STATES.keys())
def test_bad_state_dict_is_refused_and_changes_nothing(state, error, message) -> None:
    scaler = amped.GradScaler("cpu", init_scale=4.0)
    before = scaler.state_dict()
    with pytest.raises(error, match=message):
        scaler.load_state_dict(state)
    assert scaler.state_dict() == before
