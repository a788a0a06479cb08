"""What the bf16-pure optimizers share (amped.optim.seeded): the same argument checks,
and a state dict or pickle that keeps the seed, the random stream and ``fused``."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn as nn

from amped.optim import CompensatedAdamW
from amped.optim.adamw8bit import CompensatedAdamW8bit

ADAMWS = pytest.mark.parametrize(
    "kind", [CompensatedAdamW, CompensatedAdamW8bit], ids=["compensated", "8bit"]
)


def _stepped(kind: type, fused: bool | None = False, seed: int = 3) -> torch.optim.Optimizer:
    weight = nn.Parameter(torch.linspace(-1, 1, 4096, dtype=torch.bfloat16))
    opt = kind([weight], lr=1e-3, compensation="stochastic", seed=seed, fused=fused)
    weight.grad = torch.ones_like(weight)
    opt.step()
    return opt


@ADAMWS
@pytest.mark.parametrize(
    ("argument", "value", "error"),
    [
        ("lr", -1.0, ValueError),
        ("lr", "0.1", TypeError),
        ("betas", (0.9, 1.0), ValueError),
        ("eps", True, TypeError),
        ("compensation", "nearest", ValueError),
        ("fused", "yes", TypeError),
    ],
    ids=["lr-negative", "lr-string", "beta2-one", "eps-bool", "compensation", "fused"],
)
def test_both_adamws_refuse_the_same_arguments(kind: type, argument, value, error) -> None:
    with pytest.raises(error, match=argument.rstrip("s")):
        kind([nn.Parameter(torch.ones(4))], **{argument: value})


@ADAMWS
def test_load_state_dict_keeps_fused_and_restores_seed_and_stream(kind: type) -> None:
    saved = _stepped(kind, seed=3).state_dict()
    assert saved["seed"] == 3 and "rng_state" in saved
    other = _stepped(kind, fused=False, seed=9)
    other.load_state_dict(saved)
    assert other.fused is False  # torch's loading calls __setstate__; fused must survive
    assert other.seed == 3
    assert torch.equal(other.state_dict()["rng_state"], saved["rng_state"])


@ADAMWS
def test_pickle_round_trip_keeps_the_stream(kind: type) -> None:
    opt = _stepped(kind)
    again = pickle.loads(pickle.dumps(opt))
    assert again.fused is False and again.seed == opt.seed
    assert torch.equal(again.state_dict()["rng_state"], opt.state_dict()["rng_state"])
