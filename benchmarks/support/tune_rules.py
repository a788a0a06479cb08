"""``amped tune``'s plan against the best first/last-N rule: the comparison of
``benchmarks/tune.py vs-rule``.

:func:`compare` tunes, then verifies the best rules by the ground truth in turn until
one passes, judging both by tune's own verification; :func:`one_at_a_time` is the
paired per-layer ground truth on any factory (the built-in task's), :class:`Builtin`
``amped compare``'s task as a factory. Imported by ``benchmarks/tune.py`` and
tests/tuning/test_tune_ground_truth.py; never run alone.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

import amped
from amped.lowp.conv1d import linear_dims
from amped.recipes import PrecisionPlan
from amped.tasks import tiny_gpt as default_task
from amped.tuning.verify import Arm, verify_arm


def shares(model: nn.Module, names: list[str]) -> dict[str, int]:
    """in * out per layer: its GEMM FLOPs up to the (common) row count."""
    out = {}
    for name in names:
        fan_in, fan_out = linear_dims(model.get_submodule(name))
        out[name] = fan_in * fan_out
    return out


def rules(
    names: list[str], size: dict[str, int], change: dict[str, float], budget: float
) -> list[tuple[dict[str, str], int, int, float]]:
    """The (layers, N, M, summed change) of every rule within budget by the ground truth,
    the most FLOPs first (ties: the smaller change, then smaller N, then smaller M)."""
    found: list[tuple[tuple[int, float, int, int], tuple[dict[str, str], int, int, float]]] = []
    count = len(names)
    for first in range(count + 1):
        for last in range(count - first + 1):
            lowered = names[first : count - last]
            total = sum(change[n] for n in lowered)
            if total > budget:
                continue
            layers = {n: ("fmt" if n in lowered else "bf16") for n in names}
            key = (-sum(size[n] for n in lowered), total, first, last)
            found.append((key, (layers, first, last, total)))
    found.sort(key=lambda item: item[0])
    unique: dict[tuple[str, ...], tuple[dict[str, str], int, int, float]] = {}
    for _, rule in found:  # N = count and M = count lower the same nothing: keep the first
        unique.setdefault(tuple(n for n, f in rule[0].items() if f == "fmt"), rule)
    return list(unique.values())


class Builtin:
    """``amped compare``'s built-in task as a factory, with a fixed batch list per seed."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def __call__(self, seed: int = 0) -> SimpleNamespace:
        task = default_task.build(seed=seed)
        data = [next(task.batches) for _ in range(self.steps)]  # type: ignore[call-overload]
        return SimpleNamespace(
            model=task.model, batches=data, loss_fn=task.loss_fn, optimizer=task.optimizer
        )


Factory = Callable[..., SimpleNamespace]


def train_plan(factory: Factory, plan: PrecisionPlan, seed: int, last_k: int) -> float:
    """Final loss (mean of the last ``last_k`` steps) of ``plan`` on seed ``seed``."""
    torch.manual_seed(seed)
    task = factory(seed)
    setup = amped.prepare(task.model, task.optimizer(task.model), plan)
    losses = []
    for x, y in task.batches:
        with setup.autocast():
            loss = task.loss_fn(setup.model(x), y)
        setup.backward(loss)
        setup.step()
        setup.zero_grad()
        losses.append(loss.item())
    return statistics.mean(losses[-last_k:])


def one_at_a_time(
    factory: Factory, names: list[str], fmt: str, seeds: tuple[int, ...], last_k: int
) -> dict[str, dict[str, Any]]:
    """The paired per-layer ground truth on any factory (as ``tune_truth.ground_truth``)."""
    bf16 = PrecisionPlan("bf16-mixed", dict.fromkeys(names, "bf16"))
    base = {s: train_plan(factory, bf16, s, last_k) for s in seeds}
    truth = {}
    for name in names:
        plan = PrecisionPlan("bf16-mixed", {n: fmt if n == name else "bf16" for n in names})
        diffs = [train_plan(factory, plan, s, last_k) - base[s] for s in seeds]
        truth[name] = {"mean": statistics.mean(diffs), "spread": statistics.stdev(diffs),
                       "per_seed": diffs}  # fmt: skip
        print(f"  {name:34} {truth[name]['mean']:+.5f} +- {truth[name]['spread']:.5f}", flush=True)
    return truth


def tuned(
    factory: Factory,
    fmt: str,
    budget: float,
    seeds: tuple[int, ...],
    verify_steps: int | None,
    rounds: int = 4,
) -> Any:
    """``amped.tune``'s result. ``verify_steps`` None: its choice from the measurement alone
    (a 1-step, 1-seed verification, one round); else its full verification over ``seeds``
    with ``rounds`` rounds, so the plan is the one a user gets."""
    if verify_steps is None:
        return amped.tune(
            factory, formats=[fmt], steps=1, seeds=1, seed=seeds[0], budget=budget, rounds=1
        )
    return amped.tune(
        factory, formats=[fmt], steps=verify_steps, seeds=len(seeds), seed=seeds[0],
        budget=budget, rounds=rounds,
    )  # fmt: skip


def compare(
    name: str,
    factory: Factory,
    truth: dict[str, dict[str, Any]] | None,
    fmt: str,
    budget: float,
    seeds: tuple[int, ...],
    steps: int,
    verify_steps: int | None = None,
    rule_tries: int = 3,
    rounds: int = 4,
) -> dict[str, Any]:
    """Tune, then verify the best ground-truth rules in turn until one passes; the tuned
    plan and the rules are judged by the same verification (tune's own: ``steps`` steps
    over ``seeds``, paired with bfloat16-mixed, gap of the last ``steps // 10`` steps,
    passed when within the budget). With ``verify_steps`` (== ``steps``) tune's own arms
    are reused; without, the measurement's choice is trained here."""
    result = tuned(factory, fmt, budget, seeds, verify_steps, rounds)
    names = [m.name for m in result.measurements]
    torch.manual_seed(seeds[0])
    size = shares(factory(seeds[0]).model, names)
    if truth is None:
        truth = one_at_a_time(factory, names, fmt, seeds, 10)
    change = {n: truth[n]["mean"] for n in names}
    seed_list = list(seeds)

    def verify(arm: str, plan: PrecisionPlan) -> Arm:
        if verify_steps == steps:  # a plan tune trained already: its runs, not new ones
            for entry in result.rounds:
                if entry["layers"] == dict(plan.layers) and entry["completed"]:
                    return Arm(arm, dict(plan.layers), list(entry["final_losses"]))
        return verify_arm(arm, factory, plan, seed_list, steps, None)

    if verify_steps == steps:
        reference, tuned_arm = result.arms["bf16-mixed"], result.arms["plan"]
    else:
        reference = verify("bf16-mixed", PrecisionPlan("bf16-mixed", dict.fromkeys(names, "bf16")))
        tuned_arm = verify("tuned", result.plan)
    tried: list[dict[str, Any]] = []
    for layers, first, last, total in rules(names, size, change, budget)[:rule_tries]:
        plan = PrecisionPlan("bf16-mixed", {n: (fmt if f == "fmt" else "bf16")
                                            for n, f in layers.items()})  # fmt: skip
        arm = verify("rule", plan)
        tried.append({"first": first, "last": last, "truth_sum": total, "arm": arm})
        if arm.passed(reference, budget):
            break
    rule = tried[-1]
    total_size = sum(size.values())
    out: dict[str, Any] = {"budget": budget, "format": fmt, "layers": names, "truth": truth,
                           "rule_first": rule["first"], "rule_last": rule["last"],
                           "verify_steps": verify_steps, "steps": steps}  # fmt: skip
    mode = "measurement only" if verify_steps is None else f"verified, {verify_steps} steps"
    print(f"\n{name}: {fmt}, budget {budget}, seeds {list(seeds)}, tune {mode}")
    print("| arm | lowered | GEMM FLOPs lowered | truth sum | loss gap (mean +- std) | "
          "seeds | passed |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    rows = [("tuned", tuned_arm)] + [
        (f"rule (N={t['first']}, M={t['last']})", t["arm"]) for t in tried
    ]
    for label, arm in rows:
        lowered = [n for n, f in arm.layers.items() if f != "bf16"]
        gaps = [a - b for a, b in zip(arm.final_losses, reference.final_losses, strict=True)]
        entry = {"lowered": lowered, "flops_fraction": sum(size[n] for n in lowered) / total_size,
                 "truth_sum": sum(change[n] for n in lowered), "gaps": gaps,
                 "gap_mean": statistics.mean(gaps), "gap_std": statistics.stdev(gaps),
                 "passed": arm.passed(reference, budget)}  # fmt: skip
        if label == "tuned":
            out["tuned"] = entry
        else:
            out.setdefault("rules_tried", []).append(entry)
        print(f"| {label} | {len(lowered)}/{len(names)} | {entry['flops_fraction']:.1%} | "
              f"{entry['truth_sum']:+.5f} | {entry['gap_mean']:+.5f} +- {entry['gap_std']:.5f} | "
              f"{', '.join(f'{g:+.5f}' for g in gaps)} | {entry['passed']} |")  # fmt: skip
    out["rule"] = out["rules_tried"][-1]
    out["bf16_final"] = reference.final_losses
    out["tune_rule"] = {"layers": result.rule.layers, "estimate": result.rule.estimate}
    out["tune_estimates"] = {
        m.name: m.formats[fmt].loss_change_estimate for m in result.measurements
    }
    out["tune_passed"] = result.passed
    out["tune_source"] = result.source
    estimate = result.arms.get("estimate")
    if estimate is not None:
        out["tune_estimate_plan"] = {
            "lowered": [n for n, f in estimate.layers.items() if f != "bf16"],
            "gap": estimate.gap(reference),
            "passed": estimate.passed(reference, budget),
        }
    print(f"tune's plan came from: {result.source}; the estimate's own plan: "
          f"{out.get('tune_estimate_plan')}")  # fmt: skip
    out["tune_rounds"] = result.rounds
    return out
