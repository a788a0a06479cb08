"""amped.GradScaler against torch.amp.GradScaler("cpu"), the oracle: same model, data,
seeds and injected infs/NaNs; the scales, skip decisions and final parameters must be
identical, bit for bit."""

from __future__ import annotations

import functools
import io
import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from scaler_helpers import (
    Trace,
    batch,
    count_steps,
    make_optimizers,
    poison_grad,
    poisoned_loss,
    tiny_model,
)

import amped
from amped.scaling import DynamicScale

STEPS = 120
# Injected faults; between them, a scale starting near float32's top (2**120) with a
# growth interval of 3 overflows on its own every few steps, so skips and growth mix.
POISON_AT = {5: "loss_inf", 17: "grad_nan", 40: "loss_nan", 41: "loss_nan", 77: "grad_inf"}
POISON_AT[100] = "grad_inf"
SCALER_ARGS = dict(init_scale=2.0**120, growth_interval=3)
ROUND_TRIP_AT = 60

SCALERS = {
    "torch": torch.amp.GradScaler,
    "amped": amped.GradScaler,
    # The default strategy passed as an object: still torch's run, bit for bit.
    "amped-strategy": functools.partial(amped.GradScaler, strategy=DynamicScale()),
}


def through_bytes(state: dict[str, Any]) -> dict[str, Any]:
    """torch.save then torch.load(weights_only=True), as a checkpoint would."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def train(
    first: str,
    *,
    optimizer: str = "sgd",
    variant: str = "plain",
    then: str | None = None,
    steps: int = STEPS,
) -> Trace:
    """Train the tiny model with scaler ``first``; at ROUND_TRIP_AT, if ``then`` names a
    scaler, continue with a fresh one of it loaded from ``first``'s state_dict."""
    model = tiny_model()
    optimizers = make_optimizers(optimizer, model)
    calls = [[0] for _ in optimizers]
    for opt, counter in zip(optimizers, calls, strict=True):
        count_steps(opt, counter)
    scaler = SCALERS[first]("cpu", **SCALER_ARGS)
    trace = Trace()
    for step in range(steps):
        if then is not None and step == ROUND_TRIP_AT:
            state = through_bytes(scaler.state_dict())
            scaler = SCALERS[then]("cpu")
            scaler.load_state_dict(state)
        poison = POISON_AT.get(step)
        x, y = batch(step)
        for opt in optimizers:
            opt.zero_grad()
        scaler.scale(poisoned_loss(F.mse_loss(model(x), y, reduction="sum"), poison)).backward()
        poison_grad(model, poison)
        if variant == "clip":
            # Clip each optimizer's own parameters: its inf check ran before clipping,
            # so a norm taken across optimizers would spread one's NaN into the other's
            # checked gradients (in torch and in amped alike).
            for opt in optimizers:
                scaler.unscale_(opt)
                params = [p for group in opt.param_groups for p in group["params"]]
                torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)
        before = [counter[0] for counter in calls]
        for opt in optimizers:
            scaler.step(opt)
        scaler.update()
        trace.scales.append(scaler.get_scale())
        trace.stepped.append(tuple(c[0] > b for c, b in zip(calls, before, strict=True)))
    trace.params = [p.detach().clone() for p in model.parameters()]
    return trace


@functools.cache
def torch_run(optimizer: str, variant: str = "plain") -> Trace:
    """torch's run, the oracle: deterministic, so computed once per optimizer and variant
    and shared by the tests that compare with it (which only read it)."""
    return train("torch", optimizer=optimizer, variant=variant)


def assert_same_run(ours: Trace, theirs: Trace) -> None:
    assert ours.scales == theirs.scales
    assert ours.stepped == theirs.stepped
    for mine, reference in zip(ours.params, theirs.params, strict=True):
        assert torch.equal(mine, reference), "parameters differ from torch's run"
        assert torch.isfinite(mine).all(), "a non-finite gradient reached a parameter"


OPTIMIZERS = ["sgd", "adam", "adam_fused", "adam+two"]
VARIANTS = ["plain", "clip"]
# The fast subset runs each optimizer kind and each variant at least once; the slow set
# runs the rest of the product.
FAST = {("sgd", "plain"), ("adam_fused", "clip"), ("adam+two", "plain")}


@pytest.mark.parametrize(
    ("optimizer", "variant"),
    [
        pytest.param(o, v, marks=() if (o, v) in FAST else pytest.mark.slow, id=f"{o}-{v}")
        for o in OPTIMIZERS
        for v in VARIANTS
    ],
)
def test_same_scales_skips_and_params_as_torch(optimizer: str, variant: str) -> None:
    ours = train("amped", optimizer=optimizer, variant=variant)
    theirs = torch_run(optimizer, variant)
    assert_same_run(ours, theirs)
    # The run must exercise both directions of the rule, not only the injected faults.
    scales = [SCALER_ARGS["init_scale"], *theirs.scales]
    backoffs = sum(after < before for before, after in itertools.pairwise(scales))
    growths = sum(after > before for before, after in itertools.pairwise(scales))
    assert backoffs > len(POISON_AT) and growths > 5


@pytest.mark.parametrize("optimizer", ["sgd", pytest.param("adam_fused", marks=pytest.mark.slow)])
def test_default_strategy_object_is_torch_bitwise(optimizer: str) -> None:
    ours = train("amped-strategy", optimizer=optimizer, variant="clip")
    assert_same_run(ours, torch_run(optimizer, "clip"))


def test_two_optimizers_skip_separately() -> None:
    """A gradient poisoned in the first optimizer's parameters skips only that one."""
    trace = train("amped", optimizer="adam+two")
    assert trace.stepped[17] == (False, True)
    assert trace.stepped[5] == (False, False)  # a poisoned loss reaches every gradient


@pytest.mark.parametrize(
    ("first", "then"),
    [("amped", "amped"), ("torch", "amped"), ("amped", "torch"), ("amped-strategy", "torch")],
    ids=["amped-to-amped", "torch-to-amped", "amped-to-torch", "strategy-to-torch"],
)
@pytest.mark.parametrize("optimizer", ["sgd", pytest.param("adam", marks=pytest.mark.slow)])
def test_state_dict_round_trip_mid_training_continues_bitwise(
    first: str, then: str, optimizer: str
) -> None:
    resumed = train(first, optimizer=optimizer, then=then)
    uninterrupted = torch_run(optimizer)
    assert_same_run(resumed, uninterrupted)


def test_default_update_rule_matches_torch_with_changed_factors() -> None:
    """set_growth_factor & co. between iterations take effect as in torch."""
    traces = []
    for name in ("amped", "torch"):
        scaler = SCALERS[name]("cpu", init_scale=8.0, growth_interval=2)
        param = torch.zeros(3, requires_grad=True)
        optimizer = torch.optim.SGD([param], lr=0.1)
        scales = []
        for step in range(30):
            if step == 10:
                scaler.set_growth_factor(3.0)
                scaler.set_backoff_factor(0.25)
                scaler.set_growth_interval(1)
            optimizer.zero_grad()
            value = float("inf") if step % 7 == 3 else 1.0
            scaler.scale((param * value).sum()).backward()
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        traces.append(scales)
    assert traces[0] == traces[1]
