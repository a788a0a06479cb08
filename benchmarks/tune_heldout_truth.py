"""The built-in task's per-layer ground truth on other seeds than the ones it was picked on.

:mod:`tune_vs_rule` picks its rule, and tune its plan, on seeds 0-2; both arms' gaps are
then in-sample. This reruns the one-layer-at-a-time paired A/B runs
(:func:`tune_vs_rule.one_at_a_time`: each layer alone in ``--fmt``, paired with
bfloat16-mixed, ``--steps`` steps, final loss = mean of the last 10 steps) on held-out
seeds, to see whether the ranking of the layers that decides the comparison holds there.

Usage:
    python benchmarks/tune_heldout_truth.py [--seeds 3,4,5] [--steps 100] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
import tune_vs_rule as vs

from amped.tasks import tiny_gpt as default_task


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", default="3,4,5")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--fmt", default="mxfp4")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default="benchmarks/results/tune_heldout_truth.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu = platform.processor() or platform.machine()
    print(f"torch {torch.__version__}, {cpu}, threads {args.threads}, load {os.getloadavg()}")
    began = time.perf_counter()
    seeds = tuple(int(s) for s in args.seeds.split(","))
    factory = vs.Builtin(args.steps)
    # tune's layers: the nn.Linears (attention's out_proj is a subclass, not one of them)
    model = default_task.build(seed=0).model
    names = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    truth = vs.one_at_a_time(factory, names, args.fmt, seeds, 10)
    seconds = time.perf_counter() - began
    print(f"{seconds:.0f} s; load {os.getloadavg()}")
    result = {"seeds": seeds, "steps": args.steps, "format": args.fmt, "truth": truth,
              "machine": {"cpu": cpu, "threads": args.threads, "seconds": seconds,
                          "load_after": os.getloadavg()}}  # fmt: skip
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
