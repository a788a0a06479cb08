"""Does a small GPT-2 train as well with low-precision attention? Held-out loss after N
steps, per attention config and seed.

A transformers GPT-2 (random init; 2 layers, 2 heads of 32, 64 positions, float32
weights) learns sequences that repeat a random block of 8 tokens (next-token loss;
uniform guessing is ln 64 = 4.16), with AdamW, its attention converted by
``amped.integrations.transformers_attention.convert_attention``:

- ``bf16``: no attention role cast (float32 arithmetic): the control;
- ``fp8``: all six roles FP8 (e4m3 per head, gradients e5m2);
- ``fp8-all-but-ds``: the same with dS (the ``dq`` and ``dk`` roles) not cast;
- ``mxfp8``: all six roles MXFP8.

Each config runs the same seeds (the same init and batches per seed); the held-out
loss is on a fixed batch the runs never train on. A config is "within noise" where its
mean lies within the control's seed spread (min..max).

    PYTHONPATH=src python benchmarks/attention_convergence.py --steps 300 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import statistics

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from amped.integrations.transformers_attention import convert_attention

CONFIGS = ("bf16", "fp8", "fp8-all-but-ds", "mxfp8")
SEQ, VOCAB = 64, 64


def _batch(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, 8), generator=g).repeat(1, SEQ // 8)


def run(config: str, seed: int, steps: int) -> float:
    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=SEQ, vocab_size=VOCAB,
                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)  # fmt: skip
    model = GPT2LMHeadModel(cfg)
    assert convert_attention(model, config) == []
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.Generator().manual_seed(1000 + seed)
    for _ in range(steps):
        ids = _batch(16, data)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    held_out = _batch(64, torch.Generator().manual_seed(99))
    with torch.no_grad():
        return model(input_ids=held_out, labels=held_out).loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    configs = ["bf16", *(c for c in args.configs if c != "bf16")]  # the control first
    losses: dict[str, list[float]] = {}
    for config in configs:
        losses[config] = []
        for seed in args.seeds:
            losses[config].append(run(config, seed, args.steps))
            print(f"{config} seed {seed}: {losses[config][-1]:.4f}", flush=True)
    low, high = min(losses["bf16"]), max(losses["bf16"])
    print(f"{args.steps} steps, seeds {args.seeds}; held-out loss (uniform: 4.159)")
    print("| attention | " + " | ".join(f"seed {s}" for s in args.seeds) + " | mean | vs bf16 |")
    print("|---|" + "---|" * (len(args.seeds) + 2))
    for config, values in losses.items():
        mean = statistics.mean(values)
        verdict = "control" if config == "bf16" else (
            "within bf16's spread" if low <= mean <= high
            else ("above" if mean > high else "below") + " bf16's spread")  # fmt: skip
        cells = " | ".join(f"{v:.4f}" for v in values)
        print(f"| {config} | {cells} | {mean:.4f} | {verdict} |")


if __name__ == "__main__":
    main()
