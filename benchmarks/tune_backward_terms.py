"""Candidate backward-error terms for ``amped tune``'s estimate, measured offline.

From the measurement's own shadow passes (the captured inputs and output gradients, each
layer re-run alone in bf16 and in the format; no extra model pass), per layer and format:

- ``c``, ``q``: the shipped estimate's parts (docs/tune.md, "What it measures");
- ``adam``: the grad_weight error's first-order effect on the next loss through AdamW's
  normalised update, ``-lr * <g, u(Q) - u(R)>`` with ``u(G) = mean_b G_b /
  (sqrt(mean_b G_b^2) + 1e-8)`` elementwise, ``R_b``/``Q_b`` the bf16/format grad_weight
  of batch ``b`` and ``g`` their bf16 mean (per step; times the steps for a run);
- ``coherence``: the cosine between the two batches' grad_weight errors, which is about 0
  for independent (stochastically rounded) errors and positive for a systematic
  (round-to-nearest) one.

Then Spearman of the combinations against the saved ground truths (the tiny GPT-2's and
the built-in task's, as :mod:`tune_vs_rule` reads them), and the all-format sums on the
built-in task. docs/history/issue-25-tune.md has the figures.

Usage:
    python benchmarks/tune_backward_terms.py [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
from collections.abc import Callable
from typing import Any

import torch
import tune_ground_truth as gt
import tune_vs_rule as vs

from amped.lowp.convert import convert_layers
from amped.recipes.plan import format_config
from amped.tuning import measure as m
from amped.tuning.task import build_task


def _u(grads: torch.Tensor) -> torch.Tensor:
    """AdamW's normalised update direction over the batches (first step, no bias terms)."""
    return grads.mean(0) / (grads.square().mean(0).sqrt() + 1e-8)


def _format_terms(layer: Any, fmt: str, calls: Any, refs: Any, lr: float) -> dict[str, float]:
    low = copy.deepcopy(torch.nn.Sequential(layer))
    convert_layers(low, format_config(fmt), ["0"])
    ref_gw, low_gw, coherent, second = [], [], [], []
    for batch, batch_refs in zip(calls, refs, strict=True):
        r_sum: Any = 0
        q_sum: Any = 0
        first = square = 0.0
        rows_seen = 0
        for (x, g), ref in zip(batch, batch_refs, strict=True):
            got = m._run(low[0], x, g)
            r_sum = r_sum + ref["grad_weight"].double()
            q_sum = q_sum + got["grad_weight"].double()
            error = got["output"].double() - ref["output"].double()
            rows = (error * g.double()).reshape(-1, error.shape[-1]).sum(-1)
            first += float(rows.sum())
            square += float(rows.square().sum())
            rows_seen += rows.numel()
        ref_gw.append(r_sum)
        low_gw.append(q_sum)
        coherent.append(first)
        second.append(rows_seen / 2 * square)
    ref_all, low_all = torch.stack(ref_gw), torch.stack(low_gw)
    errors = low_all - ref_all
    mean_grad = ref_all.mean(0)
    return {
        "c": abs(statistics.mean(coherent)),
        "q": statistics.mean(second),
        "adam": -lr * float((mean_grad * (_u(low_all) - _u(ref_all))).sum()),
        "coherence": float((errors[0] * errors[1]).sum() / (errors[0].norm() * errors[1].norm())),
    }


def terms(factory: Callable[..., Any], seed: int, formats: list[str]) -> dict[str, Any]:
    """Per layer, per format: the candidate terms on seed ``seed``'s task (2 batches)."""
    task = build_task(factory, seed, 2)
    lr = task.make_optimizer(task.model).param_groups[0]["lr"]
    eligible, _ = m.eligible_layers(task.model, formats, set())
    captured = m._capture(task.model, list(eligible), task.batches, task.loss_fn)
    modules = dict(task.model.named_modules())
    out: dict[str, Any] = {}
    for name, fits in eligible.items():
        bf16 = copy.deepcopy(modules[name])
        refs = [[m._run(bf16, x, g) for x, g in batch] for batch in captured[name]]
        out[name] = {f: _format_terms(modules[name], f, captured[name], refs, lr) for f in fits}
    return out


COMBINATIONS: dict[str, Callable[[dict[str, float], int], float]] = {
    "c + q (shipped)": lambda t, s: t["c"] + t["q"],
    "steps * adam": lambda t, s: s * t["adam"],
    "c + q + steps * adam": lambda t, s: t["c"] + t["q"] + s * t["adam"],
}


def report(name: str, truth: dict[str, float], measured: list[dict[str, Any]], steps: int) -> None:
    names = list(truth)
    print(f"\n{name}: Spearman against the ground truth (seeds 0, 1, 2; seed-mean estimate)")
    for label, combine in COMBINATIONS.items():
        per_seed = [[combine(run[n]["mxfp4"], steps) for n in names] for run in measured]
        rhos = [gt.spearman(values, [truth[n] for n in names]) for values in per_seed]
        mean = [statistics.mean(values[i] for values in per_seed) for i in range(len(names))]
        rho_mean = gt.spearman(mean, [truth[n] for n in names])
        print(f"  {label:24} {', '.join(f'{r:.3f}' for r in rhos)}; mean {rho_mean:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {args.threads}, load {os.getloadavg()}")
    s = gt.Settings()
    truth_path = "benchmarks/results/tune_ground_truth.json"
    with open(truth_path) as f:
        gpt2_truth = {n: t["mean"] for n, t in json.load(f)["ground_truth"].items()}
    gpt2 = [terms(gt.factory(s), seed, ["mxfp4"]) for seed in s.seeds]
    report("tiny GPT-2 (17 layers, mxfp4, 30 steps)", gpt2_truth, gpt2, s.steps)
    with open("benchmarks/results/tune_vs_rule_builtin_0.005.json") as f:
        builtin_truth = {n: t["mean"] for n, t in json.load(f)["builtin"]["truth"].items()}
    builtin = [terms(vs.Builtin(100), seed, ["mxfp4", "nvfp4"]) for seed in (0, 1, 2)]
    report("built-in task (5 layers, mxfp4, 100 steps)", builtin_truth, builtin, 100)
    print("\nbuilt-in task, every layer in one format: summed c + q, summed 100 * adam; per seed")
    for fmt in ("mxfp4", "nvfp4"):
        for seed, run in enumerate(builtin):
            cq = sum(t[fmt]["c"] + t[fmt]["q"] for t in run.values())
            adam = sum(100 * t[fmt]["adam"] for t in run.values())
            coherence = [round(t[fmt]["coherence"], 2) for t in run.values()]
            print(f"  {fmt} seed {seed}: {cq:.4f}, {adam:.4f}; coherence per layer {coherence}")
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
