"""Convergence of the low-memory recipes: held-out loss after N steps, several seeds.

Two tasks: ``amped compare``'s built-in one (a tiny character-level GPT on standard-library
sources) and a tiny GPT-2 from transformers (random init, the same bytes and batches).
Recipes: ``fp32``, ``bf16-master`` (AdamW on float32 masters), ``bf16-pure-8bit`` (with
and without optimizer-in-backward) and naive bfloat16 (bfloat16 weights, torch's AdamW,
no compensation). Prints the held-out loss per seed, the mean, and the seed spread
(max - min). AdamW with the built-in task's settings (lr 3e-3, betas 0.9/0.99).

    python benchmarks/memory_convergence.py --steps 500 --seeds 0 1 2 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any

import torch
from torch import nn

import amped
from amped.optim import step_in_backward
from amped.tasks import tiny_gpt as default_task

RECIPES = ("fp32", "bf16-master", "bf16-pure-8bit", "bf16-pure-8bit+in-backward", "naive-bf16")


class GPT2Logits(nn.Module):
    """transformers' GPT-2 (2 layers, d=64, 4 heads, byte vocabulary) returning logits."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=default_task.VOCAB,
            n_positions=default_task.SEQ_LEN,
            n_embd=default_task.D_MODEL,
            n_layer=default_task.N_LAYERS,
            n_head=default_task.N_HEADS,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        self.gpt = GPT2LMHeadModel(config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.gpt(input_ids=tokens).logits


def run(task_name: str, recipe: str, seed: int, steps: int, lr: float) -> float:
    """Held-out loss after ``steps`` steps."""
    task = default_task.build(seed=seed)
    if task_name == "gpt2":
        torch.manual_seed(seed)
        task.model = GPT2Logits()
    model = task.model
    optimizer_kind = torch.optim.AdamW
    if recipe == "naive-bf16":
        model.bfloat16()
    setup = amped.prepare(
        model,
        optimizer_kind(model.parameters(), lr=lr, betas=(0.9, 0.99)),
        "bf16-mixed" if recipe == "naive-bf16" else recipe.removesuffix("+in-backward"),
    )
    if recipe.endswith("+in-backward"):
        step_in_backward(setup.optimizer)
    batches = iter(task.batches)
    for _ in range(steps):
        x, y = next(batches)
        with setup.autocast():
            loss = task.loss_fn(setup.model(x), y)
        setup.backward(loss)
        setup.step()
        setup.zero_grad()
    setup.model.eval()

    def predict(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), setup.autocast():
            return setup.model(x)

    assert task.evaluate is not None
    return task.evaluate(predict)["loss"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--tasks", nargs="+", default=["stdlib", "gpt2"])
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES))
    parser.add_argument("--lr", type=float, default=default_task.LEARNING_RATE)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu = platform.processor() or platform.machine()
    print(f"torch {torch.__version__}, {cpu}, threads {args.threads}, load {os.getloadavg()}")
    results: dict[str, Any] = {"steps": args.steps, "lr": args.lr, "runs": {}}
    for task_name in args.tasks:
        for recipe in args.recipes:
            start = time.perf_counter()
            losses = [run(task_name, recipe, s, args.steps, args.lr) for s in args.seeds]
            seconds = time.perf_counter() - start
            results["runs"][f"{task_name}/{recipe}"] = losses
            print(
                f"{task_name:7} {recipe:28} mean {statistics.mean(losses):.4f}  spread "
                f"{max(losses) - min(losses):.4f}  seeds {[round(v, 4) for v in losses]}"
                f"  ({seconds:.0f} s)",
                flush=True,
            )
    print(f"load after: {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
