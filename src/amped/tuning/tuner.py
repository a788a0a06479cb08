"""``amped.tune``: measure each layer's sensitivity per format, choose a per-layer plan
within a loss budget, and verify it by training (docs/tune.md)."""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from amped._internal.errors import type_error, value_error
from amped.lowp.attention_config import AttentionConfig, resolve_config
from amped.lowp.conv1d import linear_dims
from amped.recipes.plan import PLAN_FORMATS, PrecisionPlan
from amped.tuning.attention import (
    RoleMeasurement,
    attention_speedup,
    measure_attention,
    role_order,
    role_path,
)
from amped.tuning.choose import SPEEDUPS, Choice, plan_path, rule_plans, speedups, within
from amped.tuning.measure import LayerMeasurement, eligible_layers, measure
from amped.tuning.result import TuneResult
from amped.tuning.search import (
    Candidate,
    Search,
    round_entry,
    search_path,
    search_rules,
    train_choice,
)
from amped.tuning.task import build_task
from amped.tuning.verify import Arm, verify_arm

__all__ = ["DEFAULT_FORMATS", "REFERENCE_DIVERGED", "tune"]

REFERENCE_DIVERGED = "the bf16 reference diverged"
"""How a :class:`TuneResult`'s ``reason`` begins when bfloat16-mixed itself did not train."""

DEFAULT_FORMATS = tuple(f for f in PLAN_FORMATS if f != "bf16")
"""Every FP8 and block format a plan can hold."""

Progress = Callable[[str, int, int], None]


def _check_int(name: str, value: object, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise value_error(f"{name} is an int >= {least}", name, value)
    return int(value)


def _check_formats(formats: Sequence[str] | None) -> list[str]:
    if formats is None:
        return list(DEFAULT_FORMATS)
    if isinstance(formats, str):
        raise type_error(
            "formats is a list of format names, e.g. ['fp8-rowwise']", "formats", formats
        )
    chosen = list(dict.fromkeys(formats))
    unknown = [f for f in chosen if f not in DEFAULT_FORMATS]
    if unknown or not chosen:
        raise value_error(
            f"formats are among {', '.join(DEFAULT_FORMATS)} (at least one; 'bf16' is always "
            "a choice)",
            "formats",
            list(formats),
        )
    return chosen


def _check_budget(budget: object) -> float | None:
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real):
        raise type_error("budget is a loss change (a float >= 0) or None", "budget", budget)
    if not math.isfinite(budget) or budget < 0:
        raise value_error(
            "budget is a finite loss change >= 0 (None: the bfloat16-mixed seed spread)",
            "budget",
            budget,
        )
    return float(budget)


def _no_layer_error(model: Any, refused: dict[str, str], formats: list[str]) -> ValueError:
    seen = [
        f"{n or '<model>'} ({'x'.join(map(str, linear_dims(m)))}): {refused.get(n, '')}"
        for n, m in model.named_modules()
        if n in refused
    ]
    return value_error(
        f"amped.tune found no layer to measure for formats {formats}: it tunes nn.Linear "
        "and transformers Conv1D layers whose dims are multiples of 16 (32 for the MX "
        "formats) and that no policy module rule keeps out; give a model with such layers",
        "layers seen",
        seen or "no nn.Linear or Conv1D layer",
    )


def _reason(choice: Choice, measured: list[LayerMeasurement], budget: float) -> str | None:
    if choice.attention is not None or any(fmt != "bf16" for fmt in choice.layers.values()):
        return None
    costs = [fm.loss_change_estimate for m in measured for fm in m.formats.values()]
    cheapest = min(costs) if costs else math.inf
    return (
        f"no plan meets the budget: the smallest estimated loss change of any layer in any "
        f"format is {cheapest:.3g}, the budget is {budget:.3g}; every layer stays in bf16. "
        "Give a larger budget, or more seeds for the measured default"
    )


def _diverged_reason(reference: Arm, seeds: list[int], steps: int) -> str | None:
    """Why nothing can be chosen when bfloat16-mixed's own loss is inf or NaN (None when
    every seed's is finite): every plan is judged by its gap to that loss."""
    bad = [s for s, v in zip(seeds, reference.final_losses, strict=False) if not math.isfinite(v)]
    if not bad:
        return None
    return (
        f"{REFERENCE_DIVERGED}: bf16-mixed's loss went inf or NaN within {steps} steps on "
        f"seed(s) {', '.join(map(str, bad))} of {len(seeds)}, and every plan is judged by "
        "its gap to that loss, so none can be chosen; every layer stays in bf16. Make the "
        "task train under bf16-mixed first (a smaller learning rate, the loss computed in "
        "float32), then tune"
    )


def _renamed(arm: Arm, name: str) -> Arm:
    return Arm(name, dict(arm.layers), list(arm.final_losses), arm.completed, arm.attention)


def _with_attention(
    plan: Candidate,
    roles: list[RoleMeasurement],
    config: AttentionConfig,
    target: str,
    rounds: int,
    train: Callable[[Choice], Arm],
    reference: Arm,
    budget: float,
) -> tuple[Candidate, list[dict[str, Any]], str | None]:
    """The attention roles lowered on top of the Linear ``plan`` kept (docs/tune.md,
    "Attention roles"): the plan kept after them, the rounds trained, and why no role
    is lowered (None when some are)."""
    if not plan.arm.completed or not plan.arm.passed(reference, budget):
        return plan, [], (
            "not tried: the plan of the Linear layers did not pass its verification, and "
            "roles are tried on top of a plan that passed"
        )  # fmt: skip
    path = role_path(roles, config, plan.choice, target)
    if len(path) == 1:
        return plan, [], f"no role of {config} has a speed-up over bf16 on {target}"
    # what the Linear plan's estimate leaves of the budget (all of it for a plan over
    # the budget by the estimate, a rule that training passed)
    room = budget - plan.choice.estimate if plan.choice.estimate <= budget else budget
    first = max(i for i, c in enumerate(path) if c.estimate - plan.choice.estimate <= room)
    if first == 0:
        cheapest = min(path[1:], key=lambda c: c.estimate).estimate - plan.choice.estimate
        return plan, [], (
            f"no role fits the budget: the first role's estimated loss change is "
            f"{cheapest:.3g}, the budget leaves {room:.3g} after the Linear layers"
        )  # fmt: skip
    found = search_path(path, first, rounds, train, reference, budget)
    entries = [entry | {"source": "attention"} for entry in found.rounds]
    if found.arm.passed(reference, budget):
        return Candidate(plan.source, found.choice, found.arm), entries, None
    if not found.arm.completed:
        return plan, entries, "max_time ran out before a set of roles finished its verification"
    return plan, entries, "every set of roles trained failed its verification"


def _with_rules(
    found: Search,
    measured: list[LayerMeasurement],
    target: str,
    rounds: int,
    train: Callable[[Choice, str], Arm],
    reference: Arm,
    budget: float,
) -> tuple[Candidate, list[Candidate]]:
    """The rule candidates after the estimate's rounds (:func:`search_rules`): the plan
    kept (the best that passed, else the estimate's failed plan) and the rules trained.
    None are tried after a round cut short by ``max_time``."""
    estimate = Candidate("estimate", found.choice, found.arm)
    if not all(r["completed"] for r in found.rounds):
        return estimate, []
    passed = estimate.arm.passed(reference, budget)
    best, rules = search_rules(
        rule_plans(measured, target),
        estimate if passed else None,
        [r["layers"] for r in found.rounds],
        [r["layers"] for r in found.rounds if not r["passed"]],
        rounds,
        lambda choice: train(choice, "rule"),
        reference,
        budget,
    )
    return (estimate if best is None else best), rules


def _best_rule_tried(rules: list[Candidate], reference: Arm, budget: float) -> Candidate | None:
    """The rule arm of the report: the best rule that passed, else the first tried
    (None when no rule was trained)."""
    best = None
    for rule in rules:
        if rule.arm.passed(reference, budget) and rule.beats(best, reference):
            best = rule
    return best if best is not None else next(iter(rules), None)


def tune(
    factory: Callable[..., Any],
    *,
    formats: Sequence[str] | None = None,
    budget: float | None = None,
    steps: int = 50,
    seeds: int = 3,
    seed: int = 0,
    max_time: float | None = None,
    progress: Progress | None = None,
    target: str = "blackwell",
    measure_batches: int = 2,
    rounds: int = 4,
    module_filter: Callable[[torch.nn.Module, str], bool] | None = None,
    attention: str | AttentionConfig | None = None,
) -> TuneResult:
    """Measure each eligible layer in each format, choose a per-layer plan, verify it.

    Args:
        factory: ``factory(seed=...)`` returning ``(model, batches, loss_fn)`` or an
            :class:`amped.tasks.Task` (the contract of ``amped compare``; :mod:`amped.tasks`).
        formats: candidate formats (default: all of ``fp8-tensorwise``, ``fp8-rowwise``,
            ``fp8-rowwise-gw-hp``, ``mxfp8``, ``mxfp4``, ``nvfp4``).
        budget: the summed estimated loss change the plan may cost; None: the sample
            standard deviation of bfloat16-mixed's final loss over the seeds.
        steps: training steps of each verification run.
        seeds: verification seeds (``seed``, ``seed + 1``, ...), paired across arms.
        seed: the first seed; the measurement uses its model and batches.
        max_time: seconds after which no further verification run starts (the result
            then says the verification did not complete, and the plan does not pass).
        progress: ``progress(stage, done, total)``, stage ``"measure"`` or ``"train"``.
        target: the device whose format speeds weigh the choice
            (:data:`amped.tuning.choose.SPEEDUPS`: ``"blackwell"``, ``"hopper"``).
        measure_batches: batches of the measurement step.
        rounds: the most plans verified along the estimate's order, and again the most
            first/last-N rules verified after them: the first plan is the largest within
            the budget by the estimate; each later one moves along the estimate's order,
            to a larger plan after a pass and a smaller one after a failure (a
            bisection); then the rules that could beat the best plan so far, in the
            estimate's order (docs/tune.md, "How it verifies"). 1: that first plan and
            at most one rule.
        module_filter: ``filter(layer, qualified_name) -> bool``: the layers that may be
            lowered (default: every eligible one); the others stay in bf16.
        attention: the attention format to try in each role (a preset name such as
            ``"fp8"`` or ``"mxfp8"``, or an :class:`~amped.lowp.AttentionConfig`; its
            cast roles are the candidates). None (the default): attention is not tuned.
            Each role is measured, the roles ordered, and the plans lowering more of
            them on top of the Linear plan kept verified by the same rounds
            (docs/tune.md, "Attention roles"); ``.plan.attention`` holds the roles kept.

    Returns:
        A :class:`TuneResult`: ``.plan`` (the verified plan that passed with the most
        speed-weighted GEMM FLOPs, ties to the smaller gap; ``.source`` says whether the
        estimate or a rule proposed it) goes to :func:`amped.prepare`, ``.save(path)``
        writes tuned.json.

    Raises:
        ValueError: an unknown format or target, a negative budget, bad counts, a model
            with no eligible layer, or ``attention`` given for a model without attention
            amped converts.
        TypeError: a factory that breaks the contract.

    Example:
        >>> import torch, amped
        >>> def factory(seed):
        ...     model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
        ...                                 torch.nn.Linear(64, 16))
        ...     batches = [(torch.randn(32, 64), torch.randn(32, 16))] * 4
        ...     return model, batches, torch.nn.functional.mse_loss
        >>> result = amped.tune(factory, formats=["fp8-rowwise"], steps=4, budget=1.0)
        >>> sorted(result.plan.layers)
        ['0', '2']
    """
    start = time.monotonic()
    chosen_formats = _check_formats(formats)
    given_budget = _check_budget(budget)
    speedups(target)
    steps = _check_int("steps", steps, 1)
    seeds = _check_int("seeds", seeds, 1)
    measure_batches = _check_int("measure_batches", measure_batches, 1)
    seed = _check_int("seed", seed, 0)
    rounds = _check_int("rounds", rounds, 1)
    if max_time is not None and not (isinstance(max_time, numbers.Real) and max_time > 0):
        raise value_error("max_time is a number of seconds > 0, or None", "max_time", max_time)
    deadline = None if max_time is None else start + float(max_time)
    attention_config = None if attention is None else resolve_config(attention)

    task = build_task(factory, seed, measure_batches)
    eligible, refused = eligible_layers(task.model, chosen_formats, set())
    if module_filter is not None:
        modules = dict(task.model.named_modules())
        for name in [n for n in eligible if not module_filter(modules[n], n)]:
            del eligible[name]
            refused[name] = "not chosen by module_filter"
    if not eligible:
        raise _no_layer_error(task.model, refused, chosen_formats)
    roles: list[RoleMeasurement] = []
    not_converted: list[tuple[str, str]] = []
    if attention_config is not None:  # first: refuses a model without attention
        roles, not_converted = measure_attention(
            task.model, task.batches, task.loss_fn, attention_config
        )
    measured, count = measure(task.model, eligible, task.batches, task.loss_fn, progress)
    del task

    seed_list = [seed + i for i in range(seeds)]
    names = [m.name for m in measured]
    total, done = seeds, 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress("train", done, total)

    all_bf16 = PrecisionPlan("bf16-mixed", dict.fromkeys(names, "bf16"))
    reference = verify_arm("bf16-mixed", factory, all_bf16, seed_list, steps, deadline, tick)
    if given_budget is None:
        budget_value = reference.spread if reference.completed else 0.0
        source = f"bf16-mixed seed spread (sample std of final loss over {seeds} seeds)"
    else:
        budget_value, source = given_budget, "given"
    diverged = _diverged_reason(reference, seed_list, steps)
    path = plan_path(measured, target)
    first = 0 if diverged else within(path, budget_value)
    trained = [reference]  # every arm trained so far, for reuse

    def train(choice: Choice, name: str = "plan") -> Arm:
        nonlocal total
        total += seeds
        return train_choice(choice, name, trained, factory, seed_list, steps, deadline, tick)

    rule_arms: list[Candidate] = []
    if first == 0:  # nothing fits the budget: the all-bf16 plan, with the reason
        found = Search(path[0], train(path[0]), [])
        chosen = Candidate("estimate", found.choice, found.arm)
    else:
        found = search_path(path, first, rounds, train, reference, budget_value)
        chosen, rule_arms = _with_rules(
            found, measured, target, rounds, train, reference, budget_value
        )
    choice, rounds_run = (
        chosen.choice,
        found.rounds + [round_entry(c, reference, budget_value) for c in rule_arms],
    )
    rule = _best_rule_tried(rule_arms, reference, budget_value)
    attention_section = None
    if attention_config is not None:
        if diverged:
            attention_rounds: list[dict[str, Any]] = []
            attention_reason: str | None = "not tried: the bf16 reference diverged"
        else:
            chosen, attention_rounds, attention_reason = _with_attention(
                chosen, roles, attention_config, target, rounds, train, reference,
                budget_value,
            )  # fmt: skip
        rounds_run += attention_rounds
        attention_section = _attention_section(
            attention_config, roles, chosen.choice.attention, attention_reason, not_converted,
            target,
        )  # fmt: skip
        choice = chosen.choice
    arms = {
        "bf16-mixed": reference,
        "plan": _renamed(chosen.arm, "plan"),
        "estimate": _renamed(found.arm, "estimate"),
    }
    if rule is not None:
        arms["rule"] = _renamed(rule.arm, "rule")
    settings = {
        "formats": chosen_formats,
        "attention": None if attention_config is None else str(attention_config),
        "target": target,
        "speedups": {f: SPEEDUPS[target][f] for f in ["bf16", *chosen_formats]},
        "steps": steps,
        "seeds": seeds,
        "seed": seed,
        "seed_list": seed_list,
        "measure_batches": measure_batches,
        "rounds": rounds,
        "max_time": max_time,
        "skipped_layers": refused,
        "seconds": time.monotonic() - start,
    }
    passes = count.to_dict()
    passes["training_steps"] = {n: len(a.final_losses) * steps for n, a in arms.items()}
    passes["training_steps"]["total"] = sum(len(a.final_losses) for a in trained) * steps
    reason = diverged or _reason(choice, measured, budget_value)
    plan = PrecisionPlan("bf16-mixed", choice.layers, choice.attention)
    return TuneResult(
        plan,
        measured,
        budget_value,
        source,
        choice,
        None if rule is None else rule.choice,
        arms,
        passes,
        reason,
        settings,
        rounds_run,
        chosen.source,
        attention_section,
    )


def _attention_section(
    config: AttentionConfig,
    roles: list[RoleMeasurement],
    chosen: AttentionConfig | None,
    reason: str | None,
    not_converted: list[tuple[str, str]],
    target: str,
) -> dict[str, Any]:
    """tuned.json's ``"attention_tuning"``: what was tried, measured and kept."""
    kept = {} if chosen is None else chosen.rules()
    return {
        "config": str(config),
        "target": target,
        "speedups": {m.role: attention_speedup(config.rules()[m.role], target) for m in roles},
        "order": [m.role for m in role_order(roles)],
        "roles": {m.role: m.to_dict() | {"chosen": m.role in kept} for m in roles},
        "chosen": None if chosen is None else str(chosen),
        "reason": reason,
        "not_converted": [list(item) for item in not_converted],
    }
