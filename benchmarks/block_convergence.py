"""Convergence of the block recipes, and the NVFP4 recipe's ablation, on two tiny GPTs.

Tasks (nothing downloaded, random init, 3 seeds each):

- ``builtin``: ``amped compare``'s task (a character-level GPT, d=64, 2 layers, on
  Python's standard-library source; :mod:`amped.tasks.tiny_gpt`);
- ``gpt2``: a transformers GPT-2 (``--gpt2-dim``, 2 layers, Conv1D projections) on
  the same bytes, next-byte loss.

Variants: bf16-mixed, mxfp8, and nvfp4 with its parts (``weight_2d``,
``stochastic_rounding``, ``hadamard``, ``bf16_last``) all on, each one off, and all off
(round-to-nearest 1x16 everywhere). Each runs ``--steps`` AdamW steps; the figure is the
held-out loss. Printed as a Markdown table: per variant the mean over seeds, the gap to
bf16-mixed in % (mean of per-seed gaps), and bf16-mixed's own seed-to-seed spread
(max - min over seeds, in % of its mean) beside it.

Usage: python benchmarks/block_convergence.py [--steps 200] [--tasks builtin,gpt2]
                                              [--lr 3e-3] [--gpt2-dim 128] [--threads 1]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time

import torch

import amped
from amped.lowp.mx.block_config import BLOCK_CONFIGS
from amped.tasks import tiny_gpt as default_task

NVFP4 = BLOCK_CONFIGS["nvfp4"]
PARTS = ("weight_2d", "stochastic_rounding", "hadamard", "bf16_last")
OFF = {"weight_2d": False, "stochastic_rounding": False, "hadamard": False, "bf16_last": 0.0}
VARIANTS = {
    "bf16-mixed": ("bf16-mixed", None),
    "mxfp8": ("mxfp8", None),
    "nvfp4 (full recipe)": ("nvfp4", NVFP4),
    **{f"nvfp4 without {part}": ("nvfp4", NVFP4.replace(**{part: OFF[part]})) for part in PARTS},
    "nvfp4 every part off": ("nvfp4", NVFP4.replace(**OFF)),
}


class Gpt2Bytes(torch.nn.Module):
    """transformers' GPT-2 over bytes, returning logits."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        import transformers

        config = transformers.GPT2Config(
            vocab_size=256, n_positions=default_task.SEQ_LEN, n_embd=dim, n_layer=2,
            n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        self.gpt = transformers.GPT2LMHeadModel(config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.gpt(tokens).logits


def run(task_name: str, variant: str, seed: int, args: argparse.Namespace) -> float:
    task = default_task.build(seed=seed)
    if task_name == "gpt2":
        torch.manual_seed(seed)
        task.model = Gpt2Bytes(args.gpt2_dim)
    recipe, config = VARIANTS[variant]
    model = task.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99))
    setup = amped.prepare(model, optimizer, recipe, config=config)
    for x, y in itertools.islice(task.batches, args.steps):
        with setup.autocast():
            loss = task.loss_fn(setup.model(x), y)
        setup.backward(loss)
        setup.step()
        setup.zero_grad()
    model.eval()
    assert task.evaluate is not None

    def predict(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), setup.autocast():
            return setup.model(x)

    return task.evaluate(predict)["loss"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--tasks", default="builtin,gpt2")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--lr", type=float, default=default_task.LEARNING_RATE)
    parser.add_argument("--gpt2-dim", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",")]
    variants = args.variants.split(",")
    began = time.time()
    print(f"load {os.getloadavg()}; {args.steps} steps, lr {args.lr}, seeds {seeds}")
    for task_name in args.tasks.split(","):
        losses: dict[str, list[float]] = {}
        for v in variants:
            losses[v] = []
            for s in seeds:
                losses[v].append(run(task_name, v, s, args))
                print(f"  {task_name} {v} seed {s}: {losses[v][-1]:.4f}", flush=True)
        base = losses["bf16-mixed"]
        spread = (max(base) - min(base)) / statistics.mean(base) * 100
        print(f"\n{task_name}: held-out loss after {args.steps} steps (seeds {seeds})\n")
        print("| variant | loss (mean) | gap to bf16-mixed | bf16-mixed seed spread |")
        print("|---|---|---|---|")
        for v in variants:
            gaps = [(a / b - 1) * 100 for a, b in zip(losses[v], base, strict=True)]
            print(
                f"| {v} | {statistics.mean(losses[v]):.4f} | {statistics.mean(gaps):+.2f}% "
                f"(per seed {', '.join(f'{g:+.2f}' for g in gaps)}) | {spread:.2f}% |"
            )
    print(f"\n{time.time() - began:.0f} s; load {os.getloadavg()}")


if __name__ == "__main__":
    main()
