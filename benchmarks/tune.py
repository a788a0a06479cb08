"""``amped tune`` against training: each layer's true loss change, and tune's plan
against the best "first N / last M layers in bf16" rule.

Two subcommands, each writing a JSON (the names under ``benchmarks/results/`` that the
suite and docs/benchmarks.md read):

**ground-truth** (``benchmarks/results/tune_ground_truth.json``, read by
tests/tuning/test_tune_ground_truth.py). The model is a tiny transformers GPT-2
(4 blocks, width 64, 4 heads, context 32, a byte vocabulary, random init; nothing
downloaded) learning Python standard-library source (the bytes of ``amped compare``'s
built-in task, :mod:`amped.tasks.tiny_gpt`).

Per seed, the model first trains ``pretrain_steps`` steps in bfloat16-mixed (shared by
every run of that seed). Then, for each eligible linear layer, a paired A/B: the same
pretrained weights and the same batches train ``steps`` more steps once with only that
layer in ``fmt`` (``amped.prepare(..., fmt, module_filter=lambda m, name: name == that)``)
and once all in bfloat16-mixed. The layer's loss change is the mean over seeds of the
paired difference of the final loss (the mean training loss of the last ``last_k``
steps); its spread is the sample standard deviation of those differences over seeds.
Then (unless ``--no-tune``) ``amped.tune``'s estimate on each seed's model, and its
Spearman rank correlation with the truth.

Why it is built this way (the runs behind it: docs/decisions/008):

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

**vs-rule** (``--json``, by default ``benchmarks/results/tune_vs_rule.json``). For each
task, with one format (``--fmt``, default mxfp4) and a loss budget:

1. the per-layer ground truth: one-layer-at-a-time paired A/B runs, 3 seeds (as
   ``ground-truth``; the tiny GPT-2's is read back from ``--truth-json`` when the
   settings match, the built-in task's from ``--builtin-truth-json`` when there);
2. the tuned plan: ``amped.tune(factory, formats=[fmt], budget=..., steps=..., seeds=3)``'s
   plan after its own verification rounds (what a user gets), or with
   ``--measure-only`` its knapsack choice from the measurement alone;
3. the best rules *by the ground truth*: over every (N, M), lowering layers N .. L-M-1 to
   ``fmt``, those whose summed ground-truth loss change is within the budget, the most
   GEMM FLOPs first (ties: the smaller change). This is the rule an engineer with the
   one-at-a-time runs in hand would pick, a stronger peer than tune's own rule, which is
   picked by tune's estimate;
4. like with like: each of those rules in turn (at most 3) goes through the same
   verification as tune's plan (tune's own ``verify_arm``: the same seeds, steps, paired
   bfloat16-mixed arm and final-loss window; passed when its gap is within the budget)
   until one passes; that one "meets the same budget". The tuned plan's gap is tune's own
   verified arm (or, with ``--measure-only``, its choice trained the same way). A rule
   tune trained as one of its candidates is not trained again: its runs (the same plan,
   seeds and steps) are read from tune's rounds.

The JSON also records where tune's plan came from (``tune_source``: the estimate or a
rule) and the estimate's own plan with its gap (``tune_estimate_plan``). GEMM FLOPs are
counted from the layers' shapes (every layer sees the same rows, so a layer's share is
in * out over the sum), independently of tune's count.

Tasks: ``gpt2`` (the ground-truth model: a tiny GPT-2 with outlier channels, pretrained
in bf16, then ``steps`` steps) and ``builtin`` (``amped compare``'s task, its
:class:`~amped.tasks.tiny_gpt.TinyGPT` from random init, ``--builtin-steps`` steps).

The experiments' code is in ``benchmarks/support/``: ``tune_truth.py`` (the model,
training and ground truth, both subcommands) and ``tune_rules.py`` (the comparison).

Usage:
    python benchmarks/tune.py ground-truth [--seeds 0,1,2] [--threads 1] [--no-outliers]
                                           [--json benchmarks/results/tune_ground_truth.json]
    python benchmarks/tune.py vs-rule [--tasks gpt2,builtin] [--budget-gpt2 0.002]
                                      [--budget-builtin 0.002] [--measure-only] [--threads 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from support import tune_rules as vs  # benchmarks/support/, beside this script
from support import tune_truth as gt

from amped.comparison.environment import cpu_name


def start(threads: int) -> str:
    """Set the thread count and print the settings line; the CPU's name."""
    torch.set_num_threads(threads)
    cpu = platform.processor() or platform.machine()
    print(f"torch {torch.__version__}, {cpu}, threads {threads}, load {os.getloadavg()}")
    return cpu


def write(path: str, result: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1) + "\n")


def run_ground_truth(args: argparse.Namespace) -> None:
    cpu = start(args.threads)
    s = gt.Settings(
        fmt=args.fmt, steps=args.steps, lr=args.lr, pretrain_steps=args.pretrain_steps,
        seeds=tuple(int(x) for x in args.seeds.split(",")),
        outliers={} if args.no_outliers else dict(gt.OUTLIERS),
    )  # fmt: skip
    print(f"settings: {dataclasses.asdict(s)}")
    began = time.perf_counter()
    truth = gt.ground_truth(s)
    separated = [n for n, t in truth.items() if abs(t["mean"]) > t["spread"]]
    print(f"{len(separated)} of {len(truth)} layers' mean change exceeds its seed spread")
    result: dict[str, Any] = {"settings": dataclasses.asdict(s), "ground_truth": truth}
    if not args.no_tune:
        per_seed = [gt.tune_estimates(s, seed) for seed in s.seeds]
        names = list(truth)
        mean_estimate = {n: statistics.mean(e[n] for e in per_seed) for n in names}
        rho_first = gt.spearman([per_seed[0][n] for n in names], [truth[n]["mean"] for n in names])
        rho_mean = gt.spearman([mean_estimate[n] for n in names], [truth[n]["mean"] for n in names])
        print(f"Spearman, tune on seed {s.seeds[0]}: {rho_first:.3f}; seeds' mean: {rho_mean:.3f}")
        result["tune"] = {"estimates": per_seed, "spearman_first_seed": rho_first,
                          "spearman_mean_estimate": rho_mean}  # fmt: skip
    seconds = time.perf_counter() - began
    result["machine"] = {"cpu": cpu, "cpu_model": cpu_name(), "threads": args.threads,
                         "load_after": os.getloadavg(), "seconds": seconds}  # fmt: skip
    print(f"{seconds:.0f} s; load {os.getloadavg()}")
    write(args.json, result)


def saved_truth(path: Path, task: str, fmt: str, check: dict[str, Any]) -> Any:
    """A ground truth saved earlier for this task and format, if its settings match."""
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    if task == "gpt2":
        settings = data.get("settings", {})
        same = settings.get("fmt") == fmt and settings.get("outliers") == check
        return data["ground_truth"] if same else None
    entry = data.get(task, {})
    return entry.get("truth") if entry.get("format") == fmt else None


def run_vs_rule(args: argparse.Namespace) -> None:
    cpu = start(args.threads)
    began = time.perf_counter()
    results: dict[str, Any] = {}
    s = gt.Settings(fmt=args.fmt)
    for task in args.tasks.split(","):
        if task == "gpt2":
            truth = saved_truth(Path(args.truth_json), task, s.fmt, s.outliers)
            verify = None if args.measure_only else s.steps
            results[task] = vs.compare(task, gt.factory(s), truth, s.fmt, args.budget_gpt2,
                                       s.seeds, s.steps, verify, rounds=args.rounds)  # fmt: skip
        else:
            truth = saved_truth(Path(args.builtin_truth_json), task, args.fmt, {})
            verify = None if args.measure_only else args.builtin_steps
            results[task] = vs.compare(task, vs.Builtin(args.builtin_steps), truth, args.fmt,
                                       args.budget_builtin, (0, 1, 2), args.builtin_steps,
                                       verify, rounds=args.rounds)  # fmt: skip
    seconds = time.perf_counter() - began
    results["machine"] = {"cpu": cpu, "threads": args.threads, "load_after": os.getloadavg(),
                          "seconds": seconds}  # fmt: skip
    print(f"\n{seconds:.0f} s; load {os.getloadavg()}")
    write(args.json, results)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    truth = commands.add_parser("ground-truth", help="each layer's loss change, by training")
    truth.add_argument("--seeds", default="0,1,2")
    truth.add_argument("--fmt", default="mxfp4")
    truth.add_argument("--steps", type=int, default=gt.Settings.steps)
    truth.add_argument("--lr", type=float, default=gt.Settings.lr)
    truth.add_argument("--pretrain-steps", type=int, default=gt.Settings.pretrain_steps)
    truth.add_argument("--no-outliers", action="store_true")
    truth.add_argument("--no-tune", action="store_true", help="skip amped.tune's ranking")
    truth.add_argument("--threads", type=int, default=1)
    truth.add_argument("--json", default="benchmarks/results/tune_ground_truth.json")
    rule = commands.add_parser("vs-rule", help="tune's plan against the best first/last-N rule")
    rule.add_argument("--tasks", default="gpt2,builtin")
    rule.add_argument("--fmt", default="mxfp4")
    rule.add_argument("--budget-gpt2", type=float, default=0.002)
    rule.add_argument("--budget-builtin", type=float, default=0.002)
    rule.add_argument("--builtin-steps", type=int, default=100)
    rule.add_argument("--truth-json", default="benchmarks/results/tune_ground_truth.json")
    rule.add_argument(
        "--builtin-truth-json", default="benchmarks/results/tune_vs_rule_builtin_0.005.json"
    )
    rule.add_argument(
        "--measure-only", action="store_true",
        help="the tuned plan from tune's measurement alone (no verification rounds)",
    )  # fmt: skip
    rule.add_argument("--rounds", type=int, default=4, help="tune's verification rounds")
    rule.add_argument("--threads", type=int, default=1)
    rule.add_argument("--json", default="benchmarks/results/tune_vs_rule.json")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.command == "ground-truth":
        run_ground_truth(args)
    else:
        run_vs_rule(args)


if __name__ == "__main__":
    main()
