"""Checkpoints of the FP8 recipes across base recipes: every FP8 recipe x every base.

A checkpoint loads bitwise into a setup of the same recipe over the same base; over
another base it is refused with a message naming both (without that check an
fp8-delayed checkpoint from bf16-pure loaded silently into bf16-mixed and lost its
compensation, and the reverse failed at the next step with KeyError 'compensation').
"""

from __future__ import annotations

import io

import pytest
import torch
from recipes_helpers import batches, optimizer, train
from test_recipes_checkpoint import _assert_same
from torch import nn

import amped
from amped.recipes.lowp import FP8_BASES, FP8_RECIPE_NAMES


def _roundtrip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _model(seed: int) -> nn.Sequential:
    """Two hidden Linear layers large enough for FP8's default filter, and a head."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(32, 64),
        nn.GELU(),
        nn.Linear(64, 64),
        nn.GELU(),
        nn.Linear(64, 64),
        nn.GELU(),
        nn.Linear(64, 8),
    )


def _setup(recipe: str, base: str, seed: int = 0) -> amped.recipes.TrainSetup:
    model = _model(seed)
    return amped.prepare(model, optimizer("adamw", model.parameters()), recipe, base=base)


_SAVED: dict[tuple[str, str], dict] = {}


def _saved(recipe: str, base: str) -> dict:
    """The state of a setup trained 2 steps, once per (recipe, base) in this process."""
    key = (recipe, base)
    if key not in _SAVED:
        setup = _setup(recipe, base)
        train(setup, batches(2))
        _SAVED[key] = _roundtrip(setup.state_dict())
    return _SAVED[key]


@pytest.mark.parametrize("base", FP8_BASES)
@pytest.mark.parametrize(
    "recipe",
    [
        pytest.param(r, marks=pytest.mark.slow) if r == "fp8-blockwise" else r
        for r in FP8_RECIPE_NAMES
    ],
)
def test_same_base_loads_bitwise_and_other_bases_are_refused(recipe, base):
    saved = _saved(recipe, base)
    assert saved["fp8"]["base"] == base
    for target in FP8_BASES:
        fresh = _setup(recipe, target, seed=7)
        if target == base:
            fresh.load_state_dict(saved)
            _assert_same(_roundtrip(fresh.state_dict()), saved)
            train(fresh, batches(1))  # and it trains on
            continue
        before = _roundtrip(fresh.state_dict())
        message = rf"over base '{base}'.*over base '{target}'.*Prepare with base='{base}'"
        with pytest.raises(ValueError, match=message):
            fresh.load_state_dict(saved)
        with pytest.raises(ValueError, match=message):
            fresh.load_recipe_state_dict({k: saved[k] for k in ("recipe", "fp8", "scaler")})
        _assert_same(_roundtrip(fresh.state_dict()), before)  # nothing changed


def test_another_fp8_config_is_refused_naming_both():
    saved = _saved("fp8-tensorwise", "bf16-mixed")
    fresh = _setup("fp8-tensorwise", "bf16-mixed", seed=7)
    state = dict(saved, fp8=dict(saved["fp8"], config="i:e4m3fn/rowwise"))
    with pytest.raises(ValueError, match=r"FP8 config 'i:e4m3fn/rowwise'.*FP8 config 'i:e4m3fn"):
        fresh.load_state_dict(state)


def test_a_state_from_before_the_base_was_recorded_still_loads():
    saved = _saved("fp8-tensorwise", "bf16-mixed")
    fresh = _setup("fp8-tensorwise", "bf16-mixed", seed=7)
    fresh.load_state_dict({k: v for k, v in saved.items() if k != "fp8"})
    _assert_same(_roundtrip(fresh.state_dict()), saved)
