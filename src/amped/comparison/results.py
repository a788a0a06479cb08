"""A comparison as data: the ``results.json`` document (fields: docs/results-schema.md).

Derived figures (medians, ratios, divergence, the common step) are computed here, once,
so the console table, the HTML report and any program reading ``results.json`` agree.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Any

from amped._internal.jsonio import to_json
from amped.comparison.compare import BASELINE, Comparison
from amped.comparison.probe import PROBE_KIND
from amped.comparison.run import LOSS_WINDOW, RecipeRun, final_loss, window_mean
from amped.comparison.timing import (
    MIN_TIMED_STEPS,
    StepStats,
    ratio_range,
    speed_blocker,
    step_stats,
)
from amped.comparison.warmup import WARMUP_STEPS
from amped.recipes.attention import AttentionConversion

__all__ = ["LOSS_WINDOW", "SCHEMA_ID", "SLOW_RATIO", "divergence", "dumps", "to_dict"]

SCHEMA_ID = "amped.compare/1"
SLOW_RATIO = 1.5


def _finite(value: float | None) -> float | None:
    """The schema's numbers are finite: a loss that is not is recorded as null (no value)."""
    return value if value is not None and math.isfinite(value) else None


def _speed(runs: list[RecipeRun]) -> dict[str, Any]:
    """Whether speeds may be compared (``speed`` in ``results.json``)."""
    repeats = {}
    for run in runs:
        stats = step_stats(run.step_times)
        if stats is not None:
            repeats[run.recipe.name] = stats.repeats if len(run.step_times) > 1 else 0
    reason = speed_blocker(repeats) if len(repeats) > 1 else None
    return {"comparable": reason is None, "min_timed_steps": MIN_TIMED_STEPS, "reason": reason}


def _samples_per_step(runs: list[RecipeRun]) -> float | None:
    """The batch size the factory actually produced: mean samples per step."""
    run = next((r for r in runs if r.step_times and r.samples), None)
    return run.samples / len(run.step_times) if run else None


def to_dict(
    comparison: Comparison, environment: dict[str, Any], command: list[str]
) -> dict[str, Any]:
    """``comparison`` as the ``results.json`` document."""
    config = comparison.config
    baseline = next(
        (r for r in comparison.runs if r.recipe.name == BASELINE and r.step_times), None
    )
    done = [len(r.losses) for r in comparison.runs if r.losses]
    common = min(done) if done else None
    base_stats = step_stats(baseline.step_times) if baseline else None
    speed = _speed(comparison.runs)
    compare = baseline if speed["comparable"] else None
    per_step = _samples_per_step(comparison.runs)
    return {
        "schema": SCHEMA_ID,
        "partial": comparison.partial,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "wall_s": round(comparison.wall_s, 3),
        "config": {
            "task": config.factory.spec,
            "recipes": [r.recipe.name for r in comparison.runs],
            "steps": config.steps,
            "batch_size": config.batch_size,
            "device": str(config.device),
            "seed": config.seed,
            "max_time_s": config.max_time,
            "threads": config.threads,
            "threads_source": config.threads_source,
            "peak_memory": _peak_memory(comparison),
            "module_filter": config.layers.module_filter,
            "exclude": config.layers.exclude,
            "attention": config.attention,
        },
        "conversion": {c.recipe: c.as_dict() for c in config.conversions},
        "attention": _attention(config.attention_conversion),
        "environment": environment,
        "machine": comparison.machine,
        "task": comparison.task,
        "warmup": _warmup(comparison),
        "plan": comparison.plan.as_dict() if comparison.plan else None,
        "budget": comparison.budget.as_dict() if comparison.budget else None,
        "samples_per_step": per_step,
        "speed": speed,
        "baseline": baseline.recipe.name if baseline else None,
        "common_step": common,
        "identical_losses": identical_losses(comparison.runs),
        "recipes": [_recipe(run, baseline, compare, base_stats, common) for run in comparison.runs],
    }


def _attention(conversion: AttentionConversion | None) -> dict[str, Any] | None:
    """``--attention``: its config, and the attention modules it could not convert."""
    if conversion is None:
        return None
    return {
        "config": str(conversion.config),
        "not_converted": [{"module": n, "reason": why} for n, why in conversion.not_converted],
    }


def _peak_memory(comparison: Comparison) -> str:
    """How the peaks were measured: ``own-process`` only where the probes did it (they
    fall back to in process for every recipe when they do not fit --max-time)."""
    own = any(run.peak_memory_kind == PROBE_KIND for run in comparison.runs)
    return "own-process" if own else "in-process"


def _warmup(comparison: Comparison) -> dict[str, Any]:
    """The warm-up phase (``warmup`` in ``results.json``): outside every step time."""
    total = sum(w.seconds for w in comparison.warmups)
    return {
        "steps": WARMUP_STEPS,
        "s": round(total, 3),
        "recipes": [w.as_dict() for w in comparison.warmups],
    }


def identical_losses(runs: list[RecipeRun]) -> list[list[str]]:
    """Groups of recipes whose train losses are equal at every step (their curves coincide)."""
    groups: dict[tuple[float, ...], list[str]] = {}
    for run in runs:
        if run.losses:
            groups.setdefault(tuple(run.losses), []).append(run.recipe.name)
    return [names for names in groups.values() if len(names) > 1]


def _recipe(
    run: RecipeRun,
    baseline: RecipeRun | None,
    compare: RecipeRun | None,
    base: StepStats | None,
    common: int | None,
) -> dict[str, Any]:
    """One recipe's entry. ``compare`` is the baseline when speeds may be compared
    (every recipe timed enough steps), else None: no ratio, no "slow here"."""
    recipe = run.recipe
    stats = step_stats(run.step_times)
    per_step = run.samples / len(run.step_times) if run.step_times else 0
    speed = run.samples_per_s()
    base_speed = compare.samples_per_s() if compare is not None else None
    slowdown = stats.median / base.median if stats and base and base.median > 0 else None
    # "Slow here" needs the spreads to agree with the medians: this recipe's fast
    # quartile is slower than fp32's slow one.
    slow = bool(
        base_speed and stats and base and slowdown is not None
        and slowdown >= SLOW_RATIO and stats.q1 > base.q3
    )  # fmt: skip
    timing = stats.as_dict() if stats else None
    against_itself = baseline is not None and run is baseline
    ratios = None
    if timing and base and base_speed and not against_itself:
        ratios = ratio_range(timing, base.as_dict())
    diverged = divergence(run.losses)
    return {
        "name": recipe.name,
        "summary": recipe.summary,
        "dtype": str(recipe.dtype).removeprefix("torch.") if recipe.dtype else None,
        "weights": recipe.weights,
        "loss_scaling": recipe.loss_scaling,
        "status": run.status,
        "stop_reason": run.stop_reason,
        "error": run.error,
        "steps_requested": run.steps_requested,
        "steps_planned": run.steps_planned,
        "steps_done": len(run.losses),
        "wall_s": round(run.wall_s, 3),
        "step_time_s": stats.median if stats else None,
        "samples_per_s": speed,
        "throughput_vs_baseline": speed / base_speed if speed and base_speed else None,
        "timing": timing,
        "samples_per_s_iqr": [per_step / stats.q3, per_step / stats.q1]
        if speed and stats and stats.q1 > 0
        else None,
        "throughput_vs_baseline_range": list(ratios) if ratios and speed else None,
        "slow_on_this_hardware": slow,
        "memory": _memory(run),
        "losses": [_finite(v) for v in run.losses],
        "final_train_loss": _finite(final_loss(run.losses)),
        "train_loss_at_common_step": _finite(window_mean(run.losses, common or 0)),
        "eval": {k: _finite(v) for k, v in run.evaluation.items()} if run.evaluation else None,
        "loss_scales": list(run.loss_scales) if recipe.loss_scaling else None,
        "skipped_steps": run.skipped_steps,
        "final_loss_scale": run.final_loss_scale,
        "diverged": diverged is not None,
        "diverged_at_step": diverged,
        "notes": _notes(run, slowdown if slow else None, diverged),
    }


def _memory(run: RecipeRun) -> dict[str, Any] | None:
    state = run.state
    if state is None:
        return None
    return {
        "param_count": state.param_count,
        "params_bytes": state.params,
        "grads_bytes": state.grads,
        "optimizer_state_bytes": state.optimizer_state,
        "masters_bytes": state.masters,
        "state_bytes": state.total,
        "bytes_per_param": state.per_param,
        "source": state.source,
        "peak_bytes": run.peak_memory_bytes,
        "peak_kind": run.peak_memory_kind,
    }


def divergence(losses: list[float]) -> int | None:
    """The 1-based step from which every loss is non-finite, if the last
    :data:`LOSS_WINDOW` losses (all, if fewer) are: the run diverged. None otherwise.

    A loss-scaling recipe may see an occasional inf loss, which its scaler skips; a
    trailing window of nothing but inf/NaN is a run that no longer trains.
    """
    streak = 0
    for value in reversed(losses):
        if math.isfinite(value):
            break
        streak += 1
    if not losses or streak < min(LOSS_WINDOW, len(losses)):
        return None
    return len(losses) - streak + 1


def _notes(run: RecipeRun, slowdown: float | None, diverged: int | None) -> list[str]:
    notes = []
    if diverged is not None:
        notes.append(f"diverged: the loss is inf/NaN from step {diverged} on")
    if slowdown is not None:
        notes.append(f"slow on this hardware: {slowdown:.1f}x the fp32 step time")
    if run.stop_reason:
        notes.append(f"{run.stop_reason} after {len(run.losses)} of {run.steps_planned} steps")
    if run.error:
        notes.append(f"failed: {run.error}")
    if run.status == "not_run":
        notes.append("not run (the comparison was interrupted)")
    if run.health is not None:
        notes.append(run.health)
    return notes


def dumps(data: dict[str, Any]) -> str:
    """``data`` as JSON text, by amped's one JSON rule (:mod:`amped._internal.jsonio`)."""
    return to_json(data, indent=2) + "\n"
