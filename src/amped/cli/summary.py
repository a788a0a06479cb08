"""What a reader sees first: the comparison table's cells and footnotes, as text (the
findings are in :mod:`amped.cli.findings`).

Works on the ``results.json`` document alone, so the console table and the HTML report
show the same figures, and a report can be rebuilt from a saved ``results.json``.
"""

from __future__ import annotations

from typing import Any

from amped.cli.findings import findings
from amped.cli.results import LOSS_WINDOW

__all__ = ["COLUMNS", "GROUPS", "findings", "footnotes", "format_bytes", "headers", "rows"]

COLUMNS: tuple[tuple[str, str], ...] = (
    ("recipe", "recipe"),
    ("steps", "steps"),
    ("speed", "samples/s"),
    ("speed_iqr", "IQR"),
    ("ratio", "×fp32"),
    ("ratio_range", "range"),
    ("state", "B/param"),
    ("peak", "peak mem"),
    ("train", "loss@{common}"),
    ("eval_loss", "eval loss"),
    ("eval_acc", "eval acc"),
    ("skipped", "skips"),
    ("scale", "scale"),
    ("flags", "notes"),
)
"""(key, header) of each table column; ``{common}`` is the common step."""

GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Speed and memory", ("recipe", "speed", "speed_iqr", "ratio", "ratio_range", "state", "peak")),
    ("Loss", ("recipe", "steps", "train", "eval_loss", "eval_acc", "skipped", "scale", "flags")),
)
"""The console shows the columns as two tables, each readable at 80 columns."""

DASH = "—"


def format_bytes(count: float | None) -> str:
    if count is None:
        return DASH
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return DASH  # unreachable: the loop returns at GiB


def _number(value: float | None, spec: str) -> str:
    return DASH if value is None else format(value, spec)


def _range(pair: list[float] | None, spec: str) -> str:
    return DASH if not pair else f"{format(pair[0], spec)}–{format(pair[1], spec)}"


def headers(results: dict[str, Any]) -> list[str]:
    common = results.get("common_step")
    return [h.format(common=common if common is not None else "end") for _, h in COLUMNS]


def rows(results: dict[str, Any]) -> list[dict[str, str]]:
    """One dict per recipe, keyed by the first item of each :data:`COLUMNS` entry."""
    return [_row(r) for r in results["recipes"]]


def _row(recipe: dict[str, Any]) -> dict[str, str]:
    memory = recipe["memory"] or {}
    evaluation = recipe["eval"] or {}
    accuracy = evaluation.get("accuracy")
    scaling = recipe["loss_scaling"]
    steps = f"{recipe['steps_done']}"
    if recipe["steps_done"] != recipe["steps_requested"]:
        steps += f"/{recipe['steps_requested']}"
    return {
        "recipe": recipe["name"],
        "steps": steps,
        "speed": _number(recipe["samples_per_s"], ",.0f"),
        "speed_iqr": _range(recipe.get("samples_per_s_iqr"), ",.0f"),
        "ratio": _number(recipe["throughput_vs_baseline"], ".2f"),
        "ratio_range": _range(recipe.get("throughput_vs_baseline_range"), ".2f"),
        "state": _number(memory.get("bytes_per_param"), ".1f"),
        "peak": format_bytes(memory.get("peak_bytes")),
        "train": _number(recipe["train_loss_at_common_step"], ".3f"),
        "eval_loss": _number(evaluation.get("loss"), ".3f"),
        "eval_acc": DASH if accuracy is None else f"{accuracy:.1%}",
        "skipped": str(recipe["skipped_steps"]) if scaling else DASH,
        "scale": _number(recipe["final_loss_scale"], ".0f") if scaling else DASH,
        "flags": _flags(recipe),
    }


def _flags(recipe: dict[str, Any]) -> str:
    flags = []
    if recipe["slow_on_this_hardware"]:
        flags.append("slow here")
    if recipe.get("diverged"):
        flags.append("DIVERGED")
    if recipe["status"] in ("interrupted", "failed", "not_run"):
        flags.append(recipe["status"].replace("_", " "))
    elif recipe["stop_reason"]:
        flags.append(recipe["stop_reason"])
    return ", ".join(flags)


_PEAK = {
    "cuda_allocator_peak": "peak mem: the CUDA allocator's peak during the recipe",
    "rss_growth": "peak mem: growth of the process's resident memory during the recipe "
    "(sampled after each forward, backward and step; approximate)",
    "process_peak_rss": "peak mem: the process's peak resident memory so far",
    "own_process_peak_rss": "peak mem: each recipe run for a few steps in a process of its "
    "own: its peak resident memory less its size before amped.prepare (the kernel's peak)",
}


def footnotes(results: dict[str, Any]) -> list[str]:
    """How to read the table, then each recipe's notes."""
    kinds = {(r["memory"] or {}).get("peak_kind") for r in results["recipes"]}
    plan = results.get("plan")
    lines = [f"steps: {plan['note']}"] if plan and plan["shortened"] else []
    timing = next((r["timing"] for r in results["recipes"] if r.get("timing")), None)
    repeats = f"{timing['repeats']} timed steps" if timing else "the timed steps"
    config = results["config"]
    lines += [
        f"samples/s: batch size over the median step time of {repeats} (the first is "
        "warm-up, left out); IQR: the same at the step times' quartiles",
        "×fp32: that over fp32's; range: what the two IQRs allow",
    ]
    if config.get("threads"):
        lines.append(
            f"threads: {config['threads']} for every recipe ({config.get('threads_source')})"
        )
    lines += [
        "B/param: bytes of parameters, gradients, optimizer state and master copies per "
        "model parameter (exact)",
        *(text for kind, text in _PEAK.items() if kind in kinds),
    ]
    if _peak_is_mostly_overhead(results):
        lines.append(
            "peak mem at this model size is mostly the libraries' working memory, not the "
            "training state: B/param is the figure that orders the recipes"
        )
    if results.get("common_step") is not None:
        lines.append(
            f"loss@{results['common_step']}: mean train loss of the {LOSS_WINDOW} steps up "
            "to the last step every recipe reached (every recipe sees the same batches)"
        )
    if any(r["eval"] for r in results["recipes"]):
        lines.append("eval: held-out loss and accuracy after training")
    lines.append("skips, scale: skipped steps and final loss scale of loss-scaling recipes")
    for recipe in results["recipes"]:
        lines += [f"{recipe['name']}: {note}" for note in recipe["notes"]]
    return lines


def _peak_is_mostly_overhead(results: dict[str, Any]) -> bool:
    """Whether every peak is over 5x the recipe's training state (small models on a CPU)."""
    memories = [r["memory"] for r in results["recipes"] if r["memory"]]
    return bool(memories) and all(
        m["peak_bytes"] is not None and m["peak_bytes"] > 5 * m["state_bytes"] for m in memories
    )
