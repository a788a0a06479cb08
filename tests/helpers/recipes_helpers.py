"""A small model, data and loop shared by the recipe tests."""

from __future__ import annotations

import io

import torch
import torch.nn as nn
import torch.nn.functional as F

import amped


def mlp(seed: int = 0, norm: bool = True) -> nn.Sequential:
    """Linear(32, 64) -> LayerNorm -> GELU -> Linear(64, 8), or without the norm."""
    torch.manual_seed(seed)
    middle = [nn.LayerNorm(64)] if norm else []
    return nn.Sequential(nn.Linear(32, 64), *middle, nn.GELU(), nn.Linear(64, 8))


def teacher_data(n: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and the labels a fixed random tanh network gives them (8 classes)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g)
    w1 = torch.randn(32, 64, generator=g) / 32**0.5
    w2 = torch.randn(64, 8, generator=g) / 8
    return x, (torch.tanh(x @ w1) @ w2).argmax(-1)


def batches(steps: int, batch: int = 16, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, 32, generator=g), torch.randint(0, 8, (batch,), generator=g))
        for _ in range(steps)
    ]


def train(setup: amped.recipes.TrainSetup, data) -> list[float]:
    """The loop every recipe shares; returns the losses."""
    losses = []
    for x, y in data:
        with setup.autocast():
            loss = F.cross_entropy(setup.model(x), y)
        setup.backward(loss)
        setup.step()
        setup.zero_grad()
        losses.append(loss.item())
    return losses


def optimizer(name: str, params, lr: float | None = None) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr or 0.01, momentum=0.9)
    return torch.optim.AdamW(params, lr=lr or 1e-3)


def roundtrip(obj):
    """``obj`` through ``torch.save`` and ``torch.load(weights_only=True)``, in memory."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def setup_tensors(setup: amped.recipes.TrainSetup) -> dict[str, torch.Tensor]:
    """Everything the setup holds that training reads: model, optimizer state, masters."""
    out = {f"model.{k}": v for k, v in setup.model.state_dict().items()}
    for i, group in enumerate(setup.optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            out[f"stepped.{i}.{j}"] = p
            for key, value in setup.optimizer.state.get(p, {}).items():
                if torch.is_tensor(value):
                    out[f"state.{i}.{j}.{key}"] = value
    return out
