"""What a reader sees first: the comparison table's cells and footnotes, as text (the
findings are in :mod:`amped.comparison.findings`).

Works on the ``results.json`` document alone, so ``amped compare``'s console table and
HTML report show the same figures, and a report can be rebuilt from a saved
``results.json``; nothing here imports rich or matplotlib.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from amped.comparison.findings import findings
from amped.comparison.results import LOSS_WINDOW
from amped.comparison.run import OUT_OF_TIME

__all__ = [
    "COLUMNS",
    "GROUPS",
    "findings",
    "footnotes",
    "format_bytes",
    "headers",
    "loss_decimals",
    "rows",
    "run_facts",
    "title",
]

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


def loss_decimals(values: Sequence[float | None]) -> int:
    """Decimals that show every loss with 3 significant digits or more, and print
    losses that differ as different text (at most 8): a model that learns to 0.0051
    must not show as 0.005 for every recipe."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    nonzero = [abs(v) for v in finite if v != 0]
    if not nonzero:
        return 3
    decimals = max(3, 2 - math.floor(math.log10(min(nonzero))))
    while decimals < 8 and len({f"{v:.{decimals}f}" for v in finite}) < len(set(finite)):
        decimals += 1
    return min(decimals, 8)


def _loss_values(results: dict[str, Any]) -> list[float | None]:
    values = [r["train_loss_at_common_step"] for r in results["recipes"]]
    return values + [(r["eval"] or {}).get("loss") for r in results["recipes"]]


def run_facts(results: dict[str, Any]) -> list[str]:
    """The batch size the factory produced and the steps each recipe actually ran."""
    facts = []
    batch = results.get("samples_per_step")
    if batch is not None:
        facts.append(f"batch {batch:g}")
    done = sorted({r["steps_done"] for r in results["recipes"] if r["steps_done"]})
    if done:
        steps = f"{done[0]}" if len(done) == 1 else f"{done[0]}–{done[-1]}"
        facts.append(f"{steps} steps")
    return facts


def title(results: dict[str, Any]) -> str:
    """The comparison's one-line title: task, device, batch size, steps run."""
    task = results["task"] or {}
    name = task.get("name", results["config"]["task"])
    text = ", ".join([f"amped compare: {name} on {results['config']['device']}",
                      *run_facts(results)])  # fmt: skip
    return text + " (partial)" if results["partial"] else text


def headers(results: dict[str, Any]) -> list[str]:
    common = results.get("common_step")
    return [h.format(common=common if common is not None else "end") for _, h in COLUMNS]


def rows(results: dict[str, Any]) -> list[dict[str, str]]:
    """One dict per recipe, keyed by the first item of each :data:`COLUMNS` entry."""
    loss = f".{loss_decimals(_loss_values(results))}f"
    return [_row(r, loss) for r in results["recipes"]]


def _row(recipe: dict[str, Any], loss: str) -> dict[str, str]:
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
        "train": _number(recipe["train_loss_at_common_step"], loss),
        "eval_loss": _number(evaluation.get("loss"), loss),
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
    elif recipe["stop_reason"] and recipe["stop_reason"] != OUT_OF_TIME:
        flags.append(recipe["stop_reason"])  # out of time: the steps column shows n/N
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
    config = results["config"]
    lines += [
        f"samples/s: samples per step over the median step time of {_repeats(results)}; "
        "IQR: the same at the step times' quartiles",
    ]
    speed = results.get("speed") or {}
    if speed.get("reason"):
        lines.append(f"×fp32, range: not given: {speed['reason']}")
    else:
        lines.append("×fp32: samples/s over fp32's; range: what the two IQRs allow")
    attention = results.get("attention")
    if attention:
        left = "; ".join(f"{m['module'] or 'the model'}: {m['reason']}"
                         for m in attention["not_converted"])  # fmt: skip
        status = f"; not converted: {left}" if left else ", every module converted"
        lines.append(f"attention: {attention['config']} in every recipe{status}")
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
    common = results.get("common_step")
    if common is not None:
        window = min(LOSS_WINDOW, common)
        what = f"the {window} steps up to step {common}" if window > 1 else f"step {common}"
        lines.append(
            f"loss@{common}: mean train loss of {what}, the last step every recipe "
            "reached (every recipe sees the same batches)"
        )
    if any(r["eval"] for r in results["recipes"]):
        lines.append("eval: held-out loss and accuracy after training")
    lines.append("skips, scale: skipped steps and final loss scale of loss-scaling recipes")
    for recipe in results["recipes"]:
        lines += [f"{recipe['name']}: {note}" for note in recipe["notes"]]
    return lines


def _repeats(results: dict[str, Any]) -> str:
    """How many timed steps each recipe's speed is the median of."""
    counts = {r["name"]: r["timing"]["repeats"] for r in results["recipes"] if r.get("timing")}
    if not counts:
        return "the timed steps"
    warm = "the first step of each is warm-up, left out"
    if len(set(counts.values())) == 1:
        return f"{next(iter(counts.values()))} timed steps ({warm})"
    listed = ", ".join(f"{name} {count}" for name, count in counts.items())
    return f"each recipe's timed steps ({listed}; {warm})"


def _peak_is_mostly_overhead(results: dict[str, Any]) -> bool:
    """Whether every peak is over 5x the recipe's training state (small models on a CPU)."""
    memories = [r["memory"] for r in results["recipes"] if r["memory"]]
    return bool(memories) and all(
        m["peak_bytes"] is not None and m["peak_bytes"] > 5 * m["state_bytes"] for m in memories
    )
