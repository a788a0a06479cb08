"""Fault-injection soak: 1000 steps, ~5% poisoned at random; nothing non-finite ever
reaches a parameter or the optimizer state, exactly the poisoned steps are skipped, and
training ends where an unpoisoned run ends."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from scaler_helpers import POISONS, SOAK_REL_LOSS_GAP, poison_grad, poisoned_loss

import amped

STEPS = 1000
POISON_RATE = 0.05


def problem() -> tuple[torch.Tensor, torch.Tensor]:
    """A least-squares problem: 256 samples, 8 features, noise 0.1."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=generator)
    w = torch.randn(8, 1, generator=generator)
    return x, x @ w + 0.1 * torch.randn(256, 1, generator=generator)


def all_finite(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    tensors = list(model.parameters())
    for state in optimizer.state.values():
        tensors += [value for value in state.values() if isinstance(value, torch.Tensor)]
    return all(bool(torch.isfinite(tensor).all()) for tensor in tensors)


def soak(poisons: dict[int, str], **scaler_args) -> tuple[float, int]:
    """Train; return the final full-batch loss and the number of skipped steps."""
    x, y = problem()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    # The learning rate decays to zero, so each run settles at the optimum; the
    # scheduler skips with the optimizer.
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: 1 - done / STEPS)
    scaler = amped.GradScaler("cpu", growth_interval=50, **scaler_args)
    order = torch.Generator().manual_seed(1)
    skipped = 0
    for step in range(STEPS):
        rows = torch.randint(0, 256, (32,), generator=order)
        optimizer.zero_grad()
        loss = F.mse_loss(model(x[rows]), y[rows])
        scaler.scale(poisoned_loss(loss, poisons.get(step))).backward()
        poison_grad(model, poisons.get(step))
        scaler.step(optimizer)
        scaler.update()
        if scaler.last_step_skipped:
            skipped += 1
        else:
            schedule.step()
        assert all_finite(model, optimizer), f"non-finite state after step {step}"
    with torch.no_grad():
        return F.mse_loss(model(x), y).item(), skipped


def random_poisons(seed: int) -> dict[int, str]:
    rng = random.Random(seed)
    return {step: rng.choice(POISONS) for step in range(STEPS) if rng.random() < POISON_RATE}


STRATEGIES = {
    "default": {},
    "hysteresis-bounds": dict(hysteresis=2, min_scale=1.0, max_scale=2.0**24),
}


@pytest.mark.parametrize("scaler_args", STRATEGIES.values(), ids=STRATEGIES.keys())
def test_soak_with_poisoned_steps(scaler_args) -> None:
    poisons = random_poisons(seed=0)
    assert 30 <= len(poisons) <= 70 and set(poisons.values()) == set(POISONS)
    poisoned_loss_value, skipped = soak(poisons, **scaler_args)
    clean_loss_value, clean_skipped = soak({}, **scaler_args)
    assert skipped == len(poisons)
    assert clean_skipped == 0
    gap = abs(poisoned_loss_value - clean_loss_value) / clean_loss_value
    assert gap <= SOAK_REL_LOSS_GAP, (poisoned_loss_value, clean_loss_value)
    # Both runs reach the least-squares optimum (near the noise floor, 0.01), not
    # merely each other.
    x, y = problem()
    with_bias = torch.cat([x, torch.ones(len(x), 1)], dim=1)
    optimum = F.mse_loss(with_bias @ torch.linalg.lstsq(with_bias, y).solution, y).item()
    assert max(poisoned_loss_value, clean_loss_value) <= optimum * (1 + SOAK_REL_LOSS_GAP)
