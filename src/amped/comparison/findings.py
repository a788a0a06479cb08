"""The few sentences that answer "what does mixed precision buy this model?".

Built from the ``results.json`` document alone. A sentence makes no claim the data
cannot carry: no speed verdict at all unless every recipe timed enough steps
(``speed.comparable``), "fastest" only when that recipe's step-time range (IQR) is
clear of every other's (:func:`amped.comparison.timing.clear_winner`), a warning first when
the machine was busy or a recipe's timings spread widely (naming the recipe), and the
recipes whose losses coincide named, since their curves hide one another in the plots.
"""

from __future__ import annotations

import math
from typing import Any

from amped.comparison.timing import WIDE_SPREAD, clear_winner

__all__ = ["findings", "warnings"]


def warnings(results: dict[str, Any]) -> list[str]:
    """What makes the timings less trustworthy: a busy machine, a wide spread."""
    lines = []
    machine = results.get("machine") or {}
    if machine.get("busy"):
        others = machine.get("other_processes_cores")
        used = f"{others:.1f} of its {machine['cores']} cores" if others is not None else (
            f"a load average of {machine.get('load_average_1min')} on {machine['cores']} cores"
        )  # fmt: skip
        remedy = (
            "rerun with --threads 1 (one thread stalls least when others compete for the "
            "cores) or on an idle machine"
            if machine["threads"] > 1
            else "rerun on an idle machine"
        )
        lines.append(
            f"Busy machine: other processes used {used} while this ran, more than the "
            f"{machine['cores'] - machine['threads']} left free beside amped's "
            f"{machine['threads']} thread(s); timings are inflated and vary between runs: "
            f"{remedy}."
        )
    spread = {
        r["name"]: (r["timing"]["q3_s"] - r["timing"]["q1_s"]) / r["timing"]["median_s"]
        for r in results["recipes"]
        if r.get("timing") and r["timing"]["median_s"] > 0
    }
    wide = sorted((n for n in spread if spread[n] > WIDE_SPREAD), key=lambda n: -spread[n])
    if wide:
        listed = ", ".join(f"{name} {spread[name]:.0%}" for name in wide)
        lines.append(
            f"Wide spread: the step-time IQR is over {WIDE_SPREAD:.0%} of the median for "
            f"{listed}; rerun on an idle machine or with more --steps before trusting "
            "those recipes' speed figures."
        )
    return lines


def findings(results: dict[str, Any]) -> list[str]:
    """The warnings, then the findings, one sentence each."""
    ran = [r for r in results["recipes"] if r["samples_per_s"] or r.get("steps_done")]
    if not ran:
        return ["No recipe completed a step."]
    lines = warnings(results)
    timed = [r for r in ran if r["samples_per_s"]]  # a one-step run has no speed
    if len(timed) > 1:
        lines.append(_speed_finding(results, timed))
    plan = results.get("plan")
    if plan and plan["shortened"]:
        lines.append(f"Steps: {plan['note']}.")
    budget = results.get("budget") or {}
    lines += [f"Cut to fit --max-time: {cut}." for cut in budget.get("cut") or []]
    sized = [r for r in ran if r["memory"]]
    distinct = {round(r["memory"]["bytes_per_param"], 1) for r in sized}
    if len(sized) > 1 and len(distinct) == 1:
        lines.append(f"Training state: {distinct.pop():.1f} bytes/param for every recipe.")
    elif len(sized) > 1:
        least = min(sized, key=lambda r: r["memory"]["bytes_per_param"])
        base = next((r for r in sized if r["name"] == results["baseline"]), None)
        ref = f" (fp32: {base['memory']['bytes_per_param']:.1f})" if base else ""
        ref = "" if least is base else ref
        lines.append(
            f"Least training state: {least['name']}, "
            f"{least['memory']['bytes_per_param']:.1f} bytes/param{ref}."
        )
    lines += _loss_findings(results, ran)
    for group in results.get("identical_losses") or []:
        lines.append(
            f"Identical train loss at every step (their curves coincide): {' = '.join(group)}."
        )
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
    speed = results.get("speed") or {}
    if speed.get("reason"):
        return f"No speed verdict: {speed['reason']}."
    timings = {r["name"]: r["timing"] for r in ran if r.get("timing")}
    if len(timings) < len(ran):
        return "Speeds are not ranked: not every recipe has repeated step timings."
    winner = clear_winner(timings)
    by_median = min(ran, key=lambda r: r["timing"]["median_s"])
    if winner is not None and winner != results["baseline"]:
        fastest = next(r for r in ran if r["name"] == winner)
        ratio = fastest["throughput_vs_baseline"]  # None when fp32 did not run
        low, high = fastest.get("throughput_vs_baseline_range") or (None, None)
        span = f" (range {low:.2f}–{high:.2f})" if low is not None else ""
        against = f", {ratio:.2f}× fp32's throughput{span}" if ratio is not None else ""
        return f"Fastest: {winner}{against}; its step-time IQR is clear of every other recipe's."
    if winner is None:
        rivals = [
            r["name"]
            for r in ran
            if r is not by_median
            and r.get("timing")
            and r["timing"]["q1_s"] <= by_median["timing"]["q3_s"]
        ]
        return (
            f"No recipe is clearly fastest: {by_median['name']} has the shortest median step, "
            f"but its IQR overlaps {', '.join(rivals)}'s."
        )
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


def _percent(change: float) -> str:
    """A relative change with two significant digits, so that recipes whose losses
    differ in the fourth decimal still read differently; exactly equal is ``±0%``."""
    if change == 0:
        return "±0%"
    percent = 100 * change
    decimals = max(1, 1 - math.floor(math.log10(abs(percent))))
    return f"{percent:+.{decimals}f}%"


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
        text = _percent(change)
        (close if abs(change) <= 0.01 else off).append(f"{r['name']} ({text})")
    lines = []
    step = results["common_step"]
    if close:
        lines.append(f"Within 1% of fp32's train loss at step {step}: {', '.join(close)}.")
    if off:
        lines.append(f"Further from fp32's train loss at step {step}: {', '.join(off)}.")
    for r in ran:
        if r["loss_scaling"] and r["final_loss_scale"] is not None:
            lines.append(
                f"{r['name']}: {r['skipped_steps']} skipped step(s), "
                f"final loss scale {r['final_loss_scale']:g}."
            )
    return lines
