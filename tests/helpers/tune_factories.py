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


def tiny_gpt2(batch_size: int = 8, seed: int = 0):
    """A two-block GPT-2 from transformers (random weights, no download): its Conv1D
    projections and tied head, under transformers' module names."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    model = GPT2LMHeadModel(config)
    generator = torch.Generator().manual_seed(seed)

    def batches():
        while True:
            tokens = torch.randint(0, 128, (batch_size, 33), generator=generator)
            yield tokens[:, :-1], tokens[:, 1:]

    def loss_fn(output, targets):
        return F.cross_entropy(output.logits.flatten(0, 1), targets.flatten())

    return model, batches(), loss_fn


def diverges(batch_size: int = 32, seed: int = 0):
    """The tiny MLP with a loss scaled past float32's range: inf from the first step, in
    bfloat16-mixed as in every plan."""
    model, batches, _ = tiny(batch_size, seed)
    return model, batches, lambda out, y: F.cross_entropy(out, y) * 1e39
