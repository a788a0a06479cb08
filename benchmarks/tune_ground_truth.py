"""Ground truth for ``amped tune``: each layer's loss change, measured by training.

The model is a tiny transformers GPT-2 (4 blocks, width 64, 4 heads, context 32, a byte
vocabulary, random init; nothing downloaded) learning Python standard-library source
(the bytes of ``amped compare``'s built-in task, :mod:`amped.tasks.tiny_gpt`).

Per seed, the model first trains ``pretrain_steps`` steps in bfloat16-mixed (shared by
every run of that seed). Then, for each eligible linear layer, a paired A/B: the same
pretrained weights and the same batches train ``steps`` more steps once with only that
layer in ``fmt`` (``amped.prepare(..., fmt, module_filter=lambda m, name: name == that)``)
and once all in bfloat16-mixed. The layer's loss change is the mean over seeds of the
paired difference of the final loss (the mean training loss of the last ``last_k``
steps); its spread is the sample standard deviation of those differences over seeds.

**Why it is built this way** (the runs behind it: docs/decisions/008):

- From random init, the first few hundred steps of this GPT-2 cross loss plateaus; where a
  run leaves one shifts by tens of steps when a single layer's rounding changes, so paired
  differences after 40-60 steps were dominated by that (+-0.1 to +-0.7 in loss, sign
  flipping between seeds). A bfloat16 pretraining shared by both arms, then a short run
  at a lower learning rate, keeps the pair on one smooth trajectory.
- A block format's natural error on this model moves the final loss by about 0.1%, not
  beyond the seed-to-seed spread for most layers. So the layers get real differences by
  design: ``outliers`` multiplies a few channels (every 32nd, one per MX block) of chosen
  LayerNorm weights, so the linear layer after that norm sees an input whose block
  maximum flushes its neighbours towards zero in MXFP4 (E2M1 elements: 0.5 is the
  smallest nonzero step at a block scale of the maximum / 6). Both arms carry the same
  outliers; only the format differs.

Usage:
    python benchmarks/tune_ground_truth.py [--seeds 0,1,2] [--threads 1] [--no-outliers]
                                           [--json benchmarks/results/tune_ground_truth.json]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import amped
from amped.comparison.environment import cpu_name
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--fmt", default="mxfp4")
    parser.add_argument("--steps", type=int, default=Settings.steps)
    parser.add_argument("--lr", type=float, default=Settings.lr)
    parser.add_argument("--pretrain-steps", type=int, default=Settings.pretrain_steps)
    parser.add_argument("--no-outliers", action="store_true")
    parser.add_argument("--no-tune", action="store_true", help="skip amped.tune's ranking")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default="benchmarks/results/tune_ground_truth.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    s = Settings(
        fmt=args.fmt, steps=args.steps, lr=args.lr, pretrain_steps=args.pretrain_steps,
        seeds=tuple(int(x) for x in args.seeds.split(",")),
        outliers={} if args.no_outliers else dict(OUTLIERS),
    )  # fmt: skip
    cpu = platform.processor() or platform.machine()
    print(f"torch {torch.__version__}, {cpu}, threads {args.threads}, load {os.getloadavg()}")
    print(f"settings: {dataclasses.asdict(s)}")
    began = time.perf_counter()
    truth = ground_truth(s)
    separated = [n for n, t in truth.items() if abs(t["mean"]) > t["spread"]]
    print(f"{len(separated)} of {len(truth)} layers' mean change exceeds its seed spread")
    result: dict[str, Any] = {"settings": dataclasses.asdict(s), "ground_truth": truth}
    if not args.no_tune:
        per_seed = [tune_estimates(s, seed) for seed in s.seeds]
        names = list(truth)
        mean_estimate = {n: statistics.mean(e[n] for e in per_seed) for n in names}
        rho_first = spearman([per_seed[0][n] for n in names], [truth[n]["mean"] for n in names])
        rho_mean = spearman([mean_estimate[n] for n in names], [truth[n]["mean"] for n in names])
        print(f"Spearman, tune on seed {s.seeds[0]}: {rho_first:.3f}; seeds' mean: {rho_mean:.3f}")
        result["tune"] = {"estimates": per_seed, "spearman_first_seed": rho_first,
                          "spearman_mean_estimate": rho_mean}  # fmt: skip
    seconds = time.perf_counter() - began
    result["machine"] = {"cpu": cpu, "cpu_model": cpu_name(), "threads": args.threads,
                         "load_after": os.getloadavg(), "seconds": seconds}  # fmt: skip
    print(f"{seconds:.0f} s; load {os.getloadavg()}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
