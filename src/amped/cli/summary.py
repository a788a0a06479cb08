"""What a reader sees first: the comparison table's cells and the findings, as text.

Works on the ``results.json`` document alone, so the console table and the HTML report
show the same figures, and a report can be rebuilt from a saved ``results.json``.
"""

from __future__ import annotations

from typing import Any

from amped.cli.results import LOSS_WINDOW

__all__ = ["COLUMNS", "findings", "footnotes", "format_bytes", "headers", "rows"]

COLUMNS: tuple[tuple[str, str], ...] = (
    ("recipe", "recipe"),
    ("steps", "steps"),
    ("speed", "samples/s"),
    ("ratio", "×fp32"),
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
        "ratio": _number(recipe["throughput_vs_baseline"], ".2f"),
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
}


def footnotes(results: dict[str, Any]) -> list[str]:
    """How to read the table, then each recipe's notes."""
    kinds = {(r["memory"] or {}).get("peak_kind") for r in results["recipes"]}
    plan = results.get("plan")
    lines = [f"steps: {plan['note']}"] if plan and plan["shortened"] else []
    lines += [
        "samples/s: batch size over the median step time; ×fp32: that over fp32's",
        "B/param: bytes of parameters, gradients, optimizer state and master copies per "
        "model parameter (exact)",
        *(text for kind, text in _PEAK.items() if kind in kinds),
    ]
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


def findings(results: dict[str, Any]) -> list[str]:
    """A few sentences that answer "what does mixed precision buy this model?"."""
    ran = [r for r in results["recipes"] if r["samples_per_s"]]
    if not ran:
        return ["No recipe completed a step."]
    lines = [_speed_finding(results, ran)] if len(ran) > 1 else []
    plan = results.get("plan")
    if plan and plan["shortened"]:
        lines.append(f"Steps: {plan['note']}.")
    sized = [r for r in ran if r["memory"]]
    if len(sized) > 1:
        least = min(sized, key=lambda r: r["memory"]["bytes_per_param"])
        base = next((r for r in sized if r["name"] == results["baseline"]), None)
        ref = f" (fp32: {base['memory']['bytes_per_param']:.1f})" if base else ""
        ref = "" if least is base else ref
        lines.append(
            f"Least training state: {least['name']}, "
            f"{least['memory']['bytes_per_param']:.1f} bytes/param{ref}."
        )
    lines += _loss_findings(results, ran)
    if results["partial"]:
        lines.append("Partial results: the comparison was interrupted.")
    lines += [f"{r['name']} failed: {r['error']}" for r in results["recipes"] if r["error"]]
    lines += [
        f"{r['name']} diverged: its loss is inf/NaN from step {r['diverged_at_step']} on."
        for r in results["recipes"]
        if r.get("diverged")
    ]
    return lines


def _speed_finding(results: dict[str, Any], ran: list[dict[str, Any]]) -> str:
    fastest = max(ran, key=lambda r: r["samples_per_s"])
    ratio = fastest["throughput_vs_baseline"]
    if fastest["name"] != results["baseline"] and ratio:
        return f"Fastest: {fastest['name']}, {ratio:.2f}× fp32's throughput."
    env = results["environment"]
    native = env.get("native_low_precision") or {}
    text = f"No recipe beats fp32's throughput on this {env['device']}"
    if env["device"] == "cpu" and native.get("bfloat16") is False:
        capability = env.get("cpu_capability") or "this CPU"
        text += (
            f" ({env['cpu']}, {capability}): it has no native bfloat16 or float16 matmul, "
            "so low precision is emulated; CPUs with AVX512-BF16/AMX and GPUs speed it up"
        )
    return text + "."


def _loss_findings(results: dict[str, Any], ran: list[dict[str, Any]]) -> list[str]:
    base = next((r for r in ran if r["name"] == results["baseline"]), None)
    if base is None or base["train_loss_at_common_step"] is None:
        return []
    ref = base["train_loss_at_common_step"]
    close: list[str] = []
    off: list[str] = []
    for r in ran:
        loss = r["train_loss_at_common_step"]
        if r is base or loss is None:
            continue
        change = (loss - ref) / abs(ref)
        text = "±0.0%" if abs(change) < 0.0005 else f"{change:+.1%}"
        (close if abs(change) <= 0.01 else off).append(f"{r['name']} ({text})")
    lines = []
    step = results["common_step"]
    if close:
        lines.append(f"Within 1% of fp32's train loss at step {step}: {', '.join(close)}.")
    if off:
        lines.append(f"Further from fp32's train loss at step {step}: {', '.join(off)}.")
    scaled = [r for r in ran if r["loss_scaling"]]
    for r in scaled:
        if r["final_loss_scale"] is None:
            continue
        lines.append(
            f"{r['name']}: {r['skipped_steps']} skipped step(s), "
            f"final loss scale {r['final_loss_scale']:g}."
        )
    return lines
