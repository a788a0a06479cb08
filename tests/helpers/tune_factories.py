"""Task factories for ``amped tune --model`` in the CLI tests: a tiny MLP with three
tunable layers, and a model with none; and for ``amped.tune(..., attention=...)``, a
model whose attention role ``s`` is made sensitive to MXFP8 on purpose."""

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


ATTENTION_WIDTH, ATTENTION_HEADS, ATTENTION_SEQ = 64, 2, 32
OUTLIER = 1e7
"""A query channel's constant value in :class:`AttentionNet`: 1e7 times the others (about
1), past E4M3's range below an MX block's amax (2**-9 / 448, about 4.4e-6), so an MX
cast of a query row's 32 head dims flushes the rest of that row to zero."""


class AttentionNet(nn.Module):
    """Linear, ``nn.MultiheadAttention`` (2 heads of 32), Linear, with sharp attention
    (the query and key projections scaled by 3: softmax far from uniform).

    With ``outlier``, the first query channel of each head is the constant ``outlier``
    (its bias), and the matching key channel is 0 and kept there (its weights and bias
    get no gradient): S = Q·Kᵀ does not change, but an MXFP8 cast of Q, blocked along
    the head dim, flushes every other channel of the row, so the role ``s`` loses S
    entirely. The other roles cast Q only along positions (``dk``: dSᵀ·Q) or not at
    all, and keep their accuracy.
    """

    def __init__(self, outlier: float | None) -> None:
        super().__init__()
        width = ATTENTION_WIDTH
        self.inp = nn.Linear(width, width)
        self.attn = nn.MultiheadAttention(width, ATTENTION_HEADS, batch_first=True)
        self.out = nn.Linear(width, width)
        weight, bias = self.attn.in_proj_weight, self.attn.in_proj_bias
        with torch.no_grad():
            weight[: 2 * width] *= 3.0
        if outlier is None:
            return
        keep = torch.ones(3 * width)
        with torch.no_grad():
            for channel in range(0, width, width // ATTENTION_HEADS):
                bias[channel] = outlier
                weight[width + channel] = 0.0
                bias[width + channel] = 0.0
                keep[width + channel] = 0.0
        weight.register_hook(lambda g: g * keep[:, None])
        bias.register_hook(lambda g: g * keep)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        attended, _ = self.attn(h, h, h, need_weights=False)
        return self.out(attended)


def attention_task(seed: int = 0, outlier: float | None = OUTLIER, count: int = 4):
    """:class:`AttentionNet` learning its own float32 outputs at initialization (a
    teacher whose attention is sharp) plus noise of std 0.5: a task the model meets at
    once in float32, and that uniform attention (S lost) misses."""
    generator = torch.Generator().manual_seed(seed)
    model = AttentionNet(outlier)
    shape = (4, ATTENTION_SEQ, ATTENTION_WIDTH)
    batches = []
    for _ in range(count):
        x = torch.randn(shape, generator=generator)
        with torch.no_grad():
            target = model(x) + 0.5 * torch.randn(shape, generator=generator)
        batches.append((x, target))
    return model, batches, F.mse_loss
