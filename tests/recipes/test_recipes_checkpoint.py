"""Checkpoints of every recipe: saved, loaded into a fresh setup and trained on, they
continue bitwise; an O2 checkpoint loads into a plain float32 model and optimizer."""

from __future__ import annotations

import pytest
import torch
from recipes_helpers import batches, mlp, optimizer, roundtrip, setup_tensors, train
from tolerances import BITWISE

import amped
from amped.recipes.registry import RECIPES


def _flat(obj, prefix=""):
    """Nested dicts and lists as {path: leaf}."""
    if isinstance(obj, dict):
        return {
            k: v for key, value in obj.items() for k, v in _flat(value, f"{prefix}{key}.").items()
        }
    if isinstance(obj, (list, tuple)) and not all(isinstance(v, (int, float)) for v in obj):
        return {
            k: v for i, value in enumerate(obj) for k, v in _flat(value, f"{prefix}{i}.").items()
        }
    return {prefix: obj}


def _assert_same(a, b):
    a, b = _flat(a), _flat(b)
    assert a.keys() == b.keys()
    for key in a:
        if torch.is_tensor(a[key]):
            assert a[key].dtype == b[key].dtype, key
            torch.testing.assert_close(a[key], b[key], **BITWISE, msg=key)
        else:
            assert a[key] == b[key], key


# SGD's round trip compiles its fused master step with a cold cache (about 4 s): slow.
@pytest.mark.parametrize("opt_name", [pytest.param("sgd", marks=pytest.mark.slow), "adamw"])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_round_trip_continues_bitwise(recipe, opt_name):
    data = batches(5)
    model = mlp()
    setup = amped.prepare(model, optimizer(opt_name, model.parameters()), recipe)
    train(setup, data[:3])
    saved = roundtrip(setup.state_dict())
    train(setup, data[3:])

    fresh_model = mlp(seed=7)
    fresh = amped.prepare(fresh_model, optimizer(opt_name, fresh_model.parameters()), recipe)
    fresh.load_state_dict(saved)
    _assert_same(roundtrip(fresh.state_dict()), saved)
    train(fresh, data[3:])
    _assert_same(setup_tensors(fresh), setup_tensors(setup))
    assert fresh.scaler.state_dict() == setup.scaler.state_dict()


def test_o2_checkpoint_keeps_float32_masters_and_loads_into_a_plain_model():
    model = mlp()
    setup = amped.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "bf16-master")
    train(setup, batches(3))
    saved = roundtrip(setup.state_dict())
    assert {v.dtype for v in saved["model"].values()} == {torch.float32}

    plain = mlp(seed=3)
    plain.load_state_dict(saved["model"])
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    plain_opt.load_state_dict(saved["optimizer"])
    for (param, master), plain_param in zip(
        setup.optimizer.pairs,
        [plain[0].weight, plain[0].bias, plain[3].weight, plain[3].bias],
        strict=True,
    ):
        torch.testing.assert_close(plain_param, master, **BITWISE)
        for key, value in setup.optimizer.state[master].items():
            torch.testing.assert_close(plain_opt.state[plain_param][key], value, **BITWISE)
        # The low-precision weight is the master rounded once.
        torch.testing.assert_close(param, master.to(param.dtype), **BITWISE)
    torch.testing.assert_close(plain[1].weight, model[1].weight, **BITWISE)
    train(amped.prepare(plain, plain_opt, "fp32"), batches(1))  # and it trains on


def test_a_checkpoint_of_another_recipe_is_refused():
    model = mlp()
    setup = amped.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16-master")
    other = mlp()
    state = amped.prepare(
        other, torch.optim.SGD(other.parameters(), lr=0.1), "bf16-pure"
    ).state_dict()
    with pytest.raises(ValueError, match=r"written by recipe 'bf16-pure'.*runs 'bf16-master'"):
        setup.load_state_dict(state)
