"""Loss-scale rules against closed forms and a plain-Python reference of each rule."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scaler_helpers import BackoffOnly

import amped
from amped.scaling.strategies import Bounded, DynamicScale, Hysteresis, StaticScale

FLAGS = st.lists(st.booleans(), min_size=1, max_size=40)


def to_float32(value: float) -> float:
    """Round like torch's update kernel: the product is taken in double, stored in float."""
    return torch.tensor(value, dtype=torch.float64).float().item()


def reference_scales(
    flags: list[bool],
    *,
    init_scale: float,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 1,
    hysteresis: int = 1,
    min_scale: float | None = None,
    max_scale: float | None = None,
    dynamic: bool = True,
) -> list[float]:
    """The scale after each update, by the rules in amped.scaling.strategies."""
    scale, tracker, streak, scales = to_float32(init_scale), 0, 0, []
    for overflow in flags:
        if dynamic and overflow:
            streak, tracker = min(streak + 1, hysteresis), 0
            if streak >= hysteresis:
                scale = to_float32(scale * backoff_factor)
        elif dynamic:
            streak, tracker = 0, tracker + 1
            if tracker == growth_interval:
                tracker, grown = 0, to_float32(scale * growth_factor)
                scale = grown if math.isfinite(grown) else scale
        if min_scale is not None:
            scale = max(scale, to_float32(min_scale))
        if max_scale is not None:
            scale = min(scale, to_float32(max_scale))
        scales.append(scale)
    return scales


def drive(scaler, flags: list[bool]) -> tuple[list[float], list[bool]]:
    """Run one step per flag (True: the gradient overflows); return scales and skips."""
    param = torch.zeros(3, requires_grad=True)
    optimizer = torch.optim.SGD([param], lr=0.1)
    scales, skipped = [], []
    for overflow in flags:
        optimizer.zero_grad()
        scaler.scale((param * (math.inf if overflow else 1.0)).sum()).backward()
        before = param.detach().clone()
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
        skipped.append(torch.equal(before, param.detach()))
    return scales, skipped


@pytest.mark.parametrize(
    "flags",
    [[False] * 10, [True] * 10, [False, True] * 6, [True, True, False, False, False, True]],
    ids=["all-clean", "all-overflow", "alternating", "mixed"],
)
@pytest.mark.parametrize("make", [amped.GradScaler, torch.amp.GradScaler], ids=["amped", "torch"])
def test_growth_interval_one_closed_form(make, flags: list[bool]) -> None:
    scaler = make("cpu", init_scale=2.0**16, growth_interval=1)
    scales, skipped = drive(scaler, flags)
    clean = flags.count(False)
    assert scales[-1] == 2.0**16 * 2.0**clean * 0.5 ** flags.count(True)
    assert skipped == flags


@settings(max_examples=60, deadline=None)
@given(flags=FLAGS)
def test_closed_form_for_any_sequence(flags: list[bool]) -> None:
    scales, skipped = drive(amped.GradScaler("cpu", init_scale=2.0**16, growth_interval=1), flags)
    assert scales[-1] == 2.0**16 * 2.0 ** flags.count(False) * 0.5 ** flags.count(True)
    assert skipped == flags


@settings(max_examples=40, deadline=None)
@given(
    flags=FLAGS,
    growth_factor=st.floats(1.01, 4.0),
    backoff_factor=st.floats(0.05, 0.95),
    growth_interval=st.integers(1, 4),
    init_scale=st.floats(1.0, 2.0**120),
    explicit=st.booleans(),
)
def test_default_rule_equals_torch(
    flags, growth_factor, backoff_factor, growth_interval, init_scale, explicit
) -> None:
    args = dict(
        init_scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
    )
    # explicit: the default strategy passed as an object, strategy=DynamicScale().
    strategy = dict(strategy=DynamicScale()) if explicit else {}
    ours = drive(amped.GradScaler("cpu", **args, **strategy), flags)
    theirs = drive(torch.amp.GradScaler("cpu", **args), flags)
    assert ours == theirs
    assert ours[0] == reference_scales(flags, **args)


@settings(max_examples=60, deadline=None)
@given(
    flags=FLAGS,
    hysteresis=st.integers(1, 4),
    growth_interval=st.integers(1, 3),
    min_exponent=st.one_of(st.none(), st.integers(5, 10)),
    max_exponent=st.one_of(st.none(), st.integers(10, 14)),
)
def test_strategies_follow_the_reference_rules(
    flags, hysteresis, growth_interval, min_exponent, max_exponent
) -> None:
    args = dict(
        init_scale=2.0**10,
        growth_interval=growth_interval,
        hysteresis=hysteresis,
        min_scale=None if min_exponent is None else 2.0**min_exponent,
        max_scale=None if max_exponent is None else 2.0**max_exponent,
    )
    scales, skipped = drive(amped.GradScaler("cpu", **args), flags)
    assert scales == reference_scales(flags, **args)
    assert skipped == flags  # a strategy moves the scale, never the skip decision


def test_hysteresis_two_tolerates_one_overflow_in_a_row() -> None:
    flags = [True, False, True, False, True, True, True, False]
    scales, skipped = drive(
        amped.GradScaler("cpu", init_scale=1024.0, growth_interval=100, hysteresis=2), flags
    )
    assert scales == [1024.0, 1024.0, 1024.0, 1024.0, 1024.0, 512.0, 256.0, 256.0]
    assert skipped == flags


def test_tolerated_overflow_resets_growth() -> None:
    """As in DeepSpeed and Megatron: no growth right after an overflow, tolerated or not."""
    flags = [False, True, False, False]
    scales, _ = drive(
        amped.GradScaler("cpu", init_scale=8.0, growth_interval=2, hysteresis=3), flags
    )
    assert scales == [8.0, 8.0, 8.0, 16.0]


@pytest.mark.parametrize(
    ("kwargs", "flags", "expected"),
    [
        (dict(min_scale=2.0), [True] * 5, [4.0, 2.0, 2.0, 2.0, 2.0]),
        (dict(max_scale=32.0), [False] * 4, [16.0, 32.0, 32.0, 32.0]),
        (dict(min_scale=4.0, max_scale=16.0), [True, True, False, False], [4.0, 4.0, 8.0, 16.0]),
    ],
    ids=["min", "max", "both"],
)
def test_bounds_hold(kwargs, flags, expected) -> None:
    scaler = amped.GradScaler("cpu", init_scale=8.0, growth_interval=1, **kwargs)
    assert drive(scaler, flags)[0] == expected


def test_static_scale_never_moves_but_still_skips() -> None:
    flags = [False, False, True, False, True, True]
    scaler = amped.GradScaler("cpu", init_scale=128.0, growth_interval=1, dynamic=False)
    scales, skipped = drive(scaler, flags)
    assert scales == [128.0] * len(flags)
    assert skipped == flags


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, DynamicScale()),
        (dict(dynamic=False), StaticScale()),
        (dict(hysteresis=2), Hysteresis(DynamicScale(), 2)),
        (dict(max_scale=2.0**20), Bounded(DynamicScale(), None, 2.0**20)),
        (
            dict(hysteresis=3, min_scale=1.0),
            Bounded(Hysteresis(DynamicScale(), 3), 1.0, None),
        ),
    ],
    ids=["default", "static", "hysteresis", "max", "hysteresis+min"],
)
def test_keywords_compose_the_strategy(kwargs, expected) -> None:
    assert amped.GradScaler("cpu", **kwargs).strategy == expected
    # The same object passed as strategy= moves the scale exactly as the keywords do.
    flags = [False, True, True, False, False, True, True, True, False, False, False]
    by_keywords = drive(amped.GradScaler("cpu", init_scale=8.0, growth_interval=2, **kwargs), flags)
    by_object = drive(
        amped.GradScaler("cpu", init_scale=8.0, growth_interval=2, strategy=expected), flags
    )
    assert by_object == by_keywords


def test_a_strategy_of_ones_own() -> None:
    flags = [False, True, False, False, True, True, False]
    scaler = amped.GradScaler("cpu", init_scale=64.0, growth_interval=1, strategy=BackoffOnly())
    scales, skipped = drive(scaler, flags)
    assert scales == [64.0, 32.0, 32.0, 32.0, 16.0, 8.0, 8.0]
    assert skipped == flags
    assert scaler.state_dict()["amped"]["counters"] == {"overflows": 3}


def test_keywords_wrap_a_strategy_of_ones_own() -> None:
    # BackoffOnly halves on every overflow and never grows; hysteresis=2 tolerates the
    # first overflow of a streak, min_scale=16 stops the backoff there.
    flags = [True, False, True, True, True, True, False]
    scaler = amped.GradScaler(
        "cpu", init_scale=64.0, strategy=BackoffOnly(), hysteresis=2, min_scale=16.0
    )
    assert scaler.strategy == Bounded(Hysteresis(BackoffOnly(), 2), min_scale=16.0)
    scales, skipped = drive(scaler, flags)
    assert scales == [64.0, 64.0, 64.0, 32.0, 16.0, 16.0, 16.0]
    assert skipped == flags


def test_wrappers_compose_in_any_order() -> None:
    # Hysteresis outside Bounded: no keyword spells it, and it moves the scale as the
    # keywords' order (Bounded outside) does whenever the scale starts inside the bounds.
    flags = [True, True, True, True, False, False, True, False, False, False]
    inside_out = Hysteresis(Bounded(DynamicScale(), min_scale=2.0, max_scale=16.0), 2)
    args = dict(init_scale=8.0, growth_interval=1)
    ours = drive(amped.GradScaler("cpu", **args, strategy=inside_out), flags)
    keywords = drive(
        amped.GradScaler("cpu", **args, hysteresis=2, min_scale=2.0, max_scale=16.0), flags
    )
    assert ours == keywords
    assert ours[0] == reference_scales(flags, **args, hysteresis=2, min_scale=2.0, max_scale=16.0)


def test_scheduler_skips_with_the_optimizer_without_torch_warning() -> None:
    param = torch.zeros(3, requires_grad=True)
    optimizer = torch.optim.SGD([param], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    scaler = amped.GradScaler("cpu")
    flags = [True, False, True, False]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns if the scheduler steps first
        for overflow in flags:
            optimizer.zero_grad()
            scaler.scale((param * (math.inf if overflow else 1.0)).sum()).backward()
            scaler.step(optimizer)
            scaler.update()
            assert scaler.last_step_skipped is overflow
            if not scaler.last_step_skipped:
                scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 0.1 * 0.5 ** flags.count(False)
