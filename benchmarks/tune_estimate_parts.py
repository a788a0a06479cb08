"""Does one part of tune's estimate rank the layers better than their sum?

Hypothesis (the built-in task's ``1.linear1``, cheapest in training and the costliest block
layer by the estimate): its estimate is the coherent part (the first-order shift the
batches agree on, which training removes), so the second-order part alone (what zero-mean
noise costs) would rank the layers as training does. Measurement only, no training:

- the tiny GPT-2 of the ground-truth test: per seed (0-2) tune's per-layer parts, averaged
  over the seeds' models, against the saved one-layer truth (Spearman, as the test);
- the built-in task: the parts on held-out seeds 3-5 (averaged), against the held-out
  one-layer runs of its four block layers (docs/history/issue-25-tune.md; the head's
  held-out runs were not made, so the four block layers only).

Usage:
    python benchmarks/tune_estimate_parts.py [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
import tune_ground_truth as gt
import tune_vs_rule as vs

import amped

# Held-out one-layer truth (mxfp4, 100 steps, seeds 3-5), from docs/history/issue-25-tune.md.
HELD_OUT = {"blocks.layers.0.linear1": 0.0042, "blocks.layers.0.linear2": 0.0031,
            "blocks.layers.1.linear1": 0.0005, "blocks.layers.1.linear2": 0.0025}  # fmt: skip
PARTS = ("loss_change_estimate", "loss_change_coherent", "loss_change_second_order")


def parts(factory: object, seed: int, fmt: str) -> dict[str, dict[str, float]]:
    result = amped.tune(factory, formats=[fmt], steps=1, seeds=1, seed=seed, budget=0.0,
                        rounds=1)  # fmt: skip
    return {
        part: {m.name: getattr(m.formats[fmt], part) for m in result.measurements} for part in PARTS
    }


def averaged(per_seed: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {
        part: {n: statistics.mean(p[part][n] for p in per_seed) for n in per_seed[0][part]}
        for part in PARTS
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default="benchmarks/results/tune_estimate_parts.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load {os.getloadavg()}", flush=True)
    out: dict[str, object] = {}
    builtin = averaged([parts(vs.Builtin(4), s, "mxfp4") for s in (3, 4, 5)])
    names = list(HELD_OUT)
    out["builtin"] = {"parts": builtin, "spearman": {
        part: gt.spearman([builtin[part][n] for n in names], [HELD_OUT[n] for n in names])
        for part in PARTS}}  # fmt: skip
    print("builtin (4 block layers, held-out seeds 3-5):", out["builtin"]["spearman"], flush=True)
    s = gt.Settings()
    truth = json.loads(Path("benchmarks/results/tune_ground_truth.json").read_text())
    truth = truth["ground_truth"]
    gpt2 = averaged([parts(gt.factory(s), seed, s.fmt) for seed in s.seeds])
    names = list(truth)
    out["gpt2"] = {"parts": gpt2, "spearman": {
        part: gt.spearman([gpt2[part][n] for n in names], [truth[n]["mean"] for n in names])
        for part in PARTS}}  # fmt: skip
    print("gpt2 (17 layers, seeds 0-2):", out["gpt2"]["spearman"], flush=True)
    out["load_after"] = os.getloadavg()
    print(f"load {os.getloadavg()}")
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
