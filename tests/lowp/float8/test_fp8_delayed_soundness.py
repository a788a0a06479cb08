"""fp8-delayed stays sound: a tiny amax cannot make a scale inf, inf/NaN inputs are not
hidden by the saturating cast, and the settings that break the rule are refused.

The failures these guard against: one step with a tiny amax made a layer's scale inf and every later
gradient NaN; an inf input was clamped to the FP8 maximum, so the loss stayed finite
and the step that should be skipped was taken; margin=160 was accepted (scale 0, NaN).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import amped
from amped.lowp import Float8Config
from amped.lowp.convert import convert_layers
from amped.lowp.float8.config import DelayedScaling
from amped.lowp.float8.delayed import next_scale

STEPS = 24


def _setup(history_len: int, amax_compute: str) -> amped.recipes.TrainSetup:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    rule = DelayedScaling(history_len, amax_compute)  # type: ignore[arg-type]
    convert_layers(model, Float8Config(delayed=rule), ["0", "2"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return amped.prepare(model, optimizer, recipe="fp8-delayed")


def _scales(setup) -> torch.Tensor:
    return torch.stack([m.fp8_scale for m in setup.low_precision_layers.layers.values()])


def _train(setup, poison_step: int, poison) -> list[bool]:
    """A loop that skips a step whose loss is not finite; returns which steps trained."""
    trained = []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(8, 32, generator=generator)
        if step == poison_step:
            x = poison(x)
        with setup.autocast():
            loss = setup.model(x).float().pow(2).mean()
        finite = bool(torch.isfinite(loss))
        if finite:
            setup.backward(loss)
            setup.step()
        setup.zero_grad()
        trained.append(finite)
        assert torch.isfinite(_scales(setup)).all(), step
        assert (_scales(setup) > 0).all(), step
    return trained


def _tiny(x: torch.Tensor) -> torch.Tensor:
    return x * 1e-40  # float32 subnormals: fp8_max / amax overflows float32


def _inf(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[3, 5] = math.inf
    return x


def _nan(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[0, 0] = math.nan
    return x


@pytest.mark.parametrize("poison_step", [0, 5], ids=["first-step", "step-5"])
@pytest.mark.parametrize(
    "history", [(1, "most_recent"), (16, "max")], ids=["len1-recent", "len16-max"]
)
def test_a_tiny_amax_step_keeps_scales_finite_and_training_goes_on(history, poison_step):
    setup = _setup(*history)
    trained = _train(setup, poison_step, _tiny)
    assert all(trained)  # every loss finite, every step taken
    assert all(torch.isfinite(p).all() for p in setup.model.parameters())


@pytest.mark.parametrize("poison", [_inf, _nan], ids=["inf", "nan"])
@pytest.mark.parametrize("poison_step", [0, 5], ids=["first-step", "step-5"])
def test_a_non_finite_input_makes_the_loss_non_finite_and_only_that_step_is_skipped(
    poison, poison_step
):
    setup = _setup(16, "max")
    trained = _train(setup, poison_step, poison)
    assert trained == [step != poison_step for step in range(STEPS)]
    assert all(torch.isfinite(p).all() for p in setup.model.parameters())


def test_next_scale_is_clamped_like_the_dynamic_path():
    fp8_max, previous = torch.tensor(448.0), torch.tensor(3.0)
    tiny = next_scale(torch.tensor(1e-40), fp8_max, previous, 0)
    assert tiny.item() == pytest.approx(448.0 / 1e-12, rel=1e-6)  # amax clamped at EPS
    huge = next_scale(torch.tensor(3e38), fp8_max, previous, 64)
    assert huge.item() == 2.0**-126  # never 0: dequantizing never divides by zero
    for bad in (0.0, math.inf, math.nan):
        assert next_scale(torch.tensor(bad), fp8_max, previous, 0).item() == 3.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(margin=160), r"margin is an int in \[0, 64\].*margin=160"),
        (dict(margin=-1), r"margin is an int in \[0, 64\]"),
        (dict(margin=True), r"margin is an int"),
        (dict(margin=1.0), r"margin is an int"),
        (dict(history_len=0), r"history_len is an int in \[1, 65536\]"),
        (dict(history_len=True), r"history_len is an int"),
        (dict(history_len=1 << 20), r"history_len is an int in \[1, 65536\]"),
    ],
    ids=[
        "margin-160",
        "margin-neg",
        "margin-bool",
        "margin-float",
        "len-0",
        "len-bool",
        "len-huge",
    ],
)
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DelayedScaling(**kwargs)
