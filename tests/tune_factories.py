"""Task factories for ``amped tune --model`` in the CLI tests: a tiny MLP with three
tunable layers, and a model with none."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _batches(batch_size: int, seed: int, features: int):
    generator = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randn(batch_size, features, generator=generator)
        yield x, (x[:, : features // 2].sum(dim=1) > 0).long()


def tiny(batch_size: int = 32, seed: int = 0):
    """Three Linear layers whose dims suit every format (multiples of 32)."""
    model = nn.Sequential(
        nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 32)
    )
    return model, _batches(batch_size, seed, 64), F.cross_entropy


def no_eligible_layer(batch_size: int = 16, seed: int = 0):
    """Linear layers of 10 and 6 features: no FP8 or block GEMM takes them."""
    model = nn.Sequential(nn.Linear(10, 6), nn.ReLU(), nn.Linear(6, 2))
    return model, _batches(batch_size, seed, 10), F.cross_entropy
