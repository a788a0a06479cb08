"""The ground-truth experiment of ``benchmarks/tune.py``: each layer's loss change by training.

A tiny transformers GPT-2 (:class:`Settings`: 4 blocks, width 64, outlier channels in
chosen LayerNorms) pretrained in bfloat16-mixed per seed, then paired A/B runs with one
layer in ``fmt`` against all in bfloat16-mixed (:func:`ground_truth`); ``amped.tune``'s
estimates on the same models (:func:`tune_estimates`) and Spearman's rank correlation
(:func:`spearman`). Why it is built this way: ``benchmarks/tune.py``'s docstring and
docs/decisions/008. Imported by ``benchmarks/tune.py`` (both subcommands) and
tests/tuning/test_tune_ground_truth.py; never run alone.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import amped
from amped.tasks import tiny_gpt as default_task

Batch = tuple[torch.Tensor, torch.Tensor]

# LayerNorm -> factor for every 32nd channel: the norms feeding c_attn (ln_1) and c_fc
# (ln_2), graded so that the layers' sensitivities spread over a range.
OUTLIERS = {
    "gpt.transformer.h.0.ln_1": 2.0,
    "gpt.transformer.h.0.ln_2": 24.0,
    "gpt.transformer.h.1.ln_1": 12.0,
    "gpt.transformer.h.1.ln_2": 4.0,
    "gpt.transformer.h.2.ln_1": 32.0,
    "gpt.transformer.h.2.ln_2": 8.0,
    "gpt.transformer.h.3.ln_1": 16.0,
    "gpt.transformer.h.3.ln_2": 6.0,
}


@dataclass(frozen=True)
class Settings:
    """One ground-truth experiment: model, data, format, schedule."""

    fmt: str = "mxfp4"
    blocks: int = 4
    width: int = 64
    heads: int = 4
    seq_len: int = 32
    batch_size: int = 16
    pretrain_steps: int = 150
    pretrain_lr: float = 3e-3
    steps: int = 30
    lr: float = 1e-3
    last_k: int = 10
    seeds: tuple[int, ...] = (0, 1, 2)
    outliers: dict[str, float] = field(default_factory=lambda: dict(OUTLIERS))

    def __hash__(self) -> int:
        return hash(json.dumps(dataclasses.asdict(self), sort_keys=True))


class TinyGPT2(nn.Module):
    """transformers' GPT-2 over bytes, returning logits (module names ``gpt.transformer...``)."""

    def __init__(self, s: Settings) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=default_task.VOCAB, n_positions=s.seq_len, n_embd=s.width,
            n_layer=s.blocks, n_head=s.heads, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        self.gpt = GPT2LMHeadModel(config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.gpt(input_ids=tokens).logits


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-byte cross-entropy in float32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


@cache
def _corpus() -> torch.Tensor:
    return default_task.load_corpus().train


def batches(s: Settings, seed: int, count: int) -> list[Batch]:
    """``count`` random windows of the training text, fixed by ``seed``."""
    text = _corpus()
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        starts = torch.randint(0, len(text) - s.seq_len - 1, (s.batch_size,), generator=generator)
        chunk = text[starts[:, None] + torch.arange(s.seq_len + 1)]
        out.append((chunk[:, :-1], chunk[:, 1:]))
    return out


def train(
    model: nn.Module, recipe: str, lr: float, data: list[Batch], **kwargs: Any
) -> list[float]:
    """Train ``model`` in place under ``recipe``; the loss of every step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99))
    setup = amped.prepare(model, optimizer, recipe, **kwargs)
    losses = []
    for x, y in data:
        with setup.autocast():
            loss = loss_fn(setup.model(x), y)
        setup.backward(loss)
        setup.step()
        setup.zero_grad()
        losses.append(loss.item())
    return losses


@cache
def pretrained(s: Settings, seed: int) -> dict[str, torch.Tensor]:
    """The state of seed ``seed``'s model after its bfloat16-mixed pretraining."""
    torch.manual_seed(seed)
    model = TinyGPT2(s)
    with torch.no_grad():
        for name, factor in s.outliers.items():
            model.get_submodule(name).weight[::32] *= factor
    train(model, "bf16-mixed", s.pretrain_lr, batches(s, seed, s.pretrain_steps))
    return copy.deepcopy(model.state_dict())


def pretrained_model(s: Settings, seed: int) -> TinyGPT2:
    """A fresh copy of seed ``seed``'s pretrained model."""
    model = TinyGPT2(s)
    model.load_state_dict(pretrained(s, seed))
    return model


def finetune_batches(s: Settings, seed: int) -> list[Batch]:
    """The A/B runs' batches (other windows than the pretraining's)."""
    return batches(s, 1000 + seed, s.steps)


def final_loss(s: Settings, seed: int, layer: str | None) -> float:
    """Mean training loss of the last ``last_k`` steps, ``layer`` alone in ``s.fmt``
    (None: everything in bfloat16-mixed)."""
    model = pretrained_model(s, seed)
    if layer is None:
        losses = train(model, "bf16-mixed", s.lr, finetune_batches(s, seed))
    else:
        only = lambda m, name: name == layer  # noqa: E731
        losses = train(model, s.fmt, s.lr, finetune_batches(s, seed), module_filter=only)
    return statistics.mean(losses[-s.last_k :])


def linear_layers(s: Settings) -> list[str]:
    """The layers ``amped.tune`` measures, in model order: the blocks' Conv1D projections
    and the output head (an ``nn.Linear`` whose weight is tied to the embedding)."""
    model = TinyGPT2(s)
    return [
        name
        for name, m in model.named_modules()
        if type(m).__name__ == "Conv1D" or type(m) is nn.Linear
    ]


def ground_truth(
    s: Settings, layers: list[str] | None = None, log: Callable[[str], None] = print
) -> dict[str, dict[str, Any]]:
    """Per layer: the paired loss changes per seed, their mean and sample std."""
    layers = linear_layers(s) if layers is None else layers
    base = {seed: final_loss(s, seed, None) for seed in s.seeds}
    log(f"bf16-mixed final loss per seed: {[round(v, 4) for v in base.values()]}")
    truth = {}
    for name in layers:
        diffs = [final_loss(s, seed, name) - base[seed] for seed in s.seeds]
        spread = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
        truth[name] = {"mean": statistics.mean(diffs), "spread": spread, "per_seed": diffs}
        per_seed = ", ".join(f"{d:+.5f}" for d in diffs)
        log(f"  {name:34} {truth[name]['mean']:+.5f} +- {spread:.5f}  ({per_seed})")
    return truth


def factory(s: Settings) -> Callable[..., SimpleNamespace]:
    """The ``amped compare``/``amped.tune`` factory of this experiment's A/B runs: the
    model, batches, loss and optimizer (AdamW, ``s.lr``) of seed ``seed``."""

    def optimizer(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=s.lr, betas=(0.9, 0.99))

    def build(seed: int = 0) -> SimpleNamespace:
        model = pretrained_model(s, seed)
        return SimpleNamespace(
            model=model, batches=finetune_batches(s, seed), loss_fn=loss_fn, optimizer=optimizer
        )

    return build


def tune_estimates(s: Settings, seed: int, measure_batches: int = 2) -> dict[str, float]:
    """``amped.tune``'s first-order loss-change estimate per layer for ``s.fmt``, measured on
    seed ``seed``'s pretrained model (the measurement only: a 1-step, 1-seed verification
    and one round)."""
    result = amped.tune(
        factory(s), formats=[s.fmt], steps=1, seeds=1, seed=seed, budget=0.0,
        measure_batches=measure_batches, rounds=1,
    )  # fmt: skip
    return {m.name: m.formats[s.fmt].loss_change_estimate for m in result.measurements}


def ranks(values: list[float]) -> list[float]:
    """Ranks from 1, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks."""
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var_a = sum((x - ma) ** 2 for x in ra)
    var_b = sum((y - mb) ** 2 for y in rb)
    return cov / (var_a * var_b) ** 0.5
