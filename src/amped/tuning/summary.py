"""What ``amped tune`` shows, as text: the per-layer rows, the verification rows and the
outcome, read from the ``tuned.json`` document alone.

``amped tune``'s terminal table and HTML report both render these, so they show the
same figures, and a report can be rebuilt from a saved ``tuned.json``; nothing here
imports rich or matplotlib.
"""

from __future__ import annotations

import math
from typing import Any, Literal

__all__ = [
    "DASH",
    "Outcome",
    "attention_rows",
    "attention_text",
    "candidate_formats",
    "format_estimate",
    "format_flops",
    "headline",
    "layer_rows",
    "lowered_share",
    "outcome",
    "rule_text",
    "source_text",
    "verification_rows",
]

DASH = "—"
Outcome = Literal["passed", "failed", "incomplete", "no_plan"]


def format_flops(count: float | None) -> str:
    """A FLOP count with an SI prefix: ``98.3M``, ``1.2G``."""
    if count is None:
        return DASH
    for unit in ("", "k", "M", "G", "T"):
        if abs(count) < 1000 or unit == "T":
            return f"{count:.0f}" if unit == "" else f"{count:.1f}{unit}"
        count /= 1000
    return DASH  # unreachable: the loop returns at T


def format_estimate(value: float | None) -> str:
    """An estimated loss change, 2 significant digits (``2.1e-04``)."""
    if value is None or not math.isfinite(value):
        return DASH if value is None else str(value)
    return f"{value:.1e}"


def _sqnr(value: float | None) -> str:
    if value is None:
        return DASH
    return "inf" if value == math.inf else f"{value:.0f}"


def candidate_formats(tuned: dict[str, Any]) -> list[str]:
    """The formats measured, in the order the tuner tried them."""
    seen: list[str] = list(tuned["settings"]["formats"])
    for layer in tuned["measurements"].values():
        seen += [f for f in layer["formats"] if f not in seen]
    return seen


def layer_rows(tuned: dict[str, Any]) -> list[dict[str, str]]:
    """One row per measured layer, in model order: ``layer``, ``flops``, one
    ``SQNR dB / estimate`` cell per candidate format (a dash where the layer cannot run
    the format), and ``choice``."""
    formats = candidate_formats(tuned)
    rows = []
    for name, layer in tuned["measurements"].items():
        row = {"layer": name, "flops": format_flops(layer["flops"])}
        for fmt in formats:
            figures = layer["formats"].get(fmt)
            row[fmt] = DASH if figures is None else (
                f"{_sqnr(figures['sqnr_output'])} dB / "
                f"{format_estimate(figures['loss_change_estimate'])}"
            )  # fmt: skip
        row["choice"] = tuned["layers"].get(name, "bf16")
        rows.append(row)
    return rows


def lowered_share(tuned: dict[str, Any], layers: dict[str, str]) -> float:
    """The fraction of the measured GEMM FLOPs that ``layers`` puts in a format other
    than bf16 (0 when nothing was measured)."""
    measured = tuned["measurements"]
    total = sum(m["flops"] for m in measured.values())
    low = sum(m["flops"] for n, m in measured.items() if layers.get(n, "bf16") != "bf16")
    return low / total if total else 0.0


def outcome(tuned: dict[str, Any]) -> Outcome:
    """``no_plan``: no lowered plan met the budget (the all-bf16 plan is written, with
    the reason); ``incomplete``: ``--max-time`` ran out before the verification
    finished (the plan does not pass); ``failed``: the plan's verified loss gap exceeds
    the budget; ``passed``."""
    if tuned["reason"] is not None:
        return "no_plan"
    if tuned["passed"]:
        return "passed"
    arms = tuned["verification"]["arms"].values()
    return "failed" if all(arm["completed"] for arm in arms) else "incomplete"


def _budget(tuned: dict[str, Any]) -> str:
    budget = tuned["budget"]
    return f"{format_estimate(budget['value'])} ({budget['source']})"


def headline(tuned: dict[str, Any]) -> str:
    """One sentence: what the plan lowers, against which budget, and how it verified."""
    state = outcome(tuned)
    if state == "no_plan":
        reason = str(tuned["reason"]).rstrip(".")
        return f"{reason[:1].upper()}{reason[1:]}."
    layers = tuned["layers"]
    lowered = sum(1 for f in layers.values() if f != "bf16")
    text = (
        f"The plan lowers {lowered} of {len(tuned['measurements'])} layers "
        f"({lowered_share(tuned, layers):.0%} of the GEMM FLOPs) at an estimated loss "
        f"change of {format_estimate(tuned['budget']['plan_estimate'])}; budget "
        f"{_budget(tuned)}; {len(tuned['rounds'])} verification round(s)."
    )
    plan = tuned["verification"]["arms"]["plan"]
    if tuned.get("attention_tuning") is not None:
        text = f"{text} {attention_text(tuned)}"
    if state == "incomplete":
        return f"{text} Verification incomplete: --max-time ran out, so the plan does not pass."
    verdict = "passed" if state == "passed" else "FAILED"
    return (
        f"{text} Verification {verdict}: the plan's mean final loss is {plan['gap']:+.4g} "
        f"from bf16-mixed's over the seeds. {source_text(tuned)}"
    )


def attention_rows(tuned: dict[str, Any]) -> list[dict[str, str]]:
    """With ``tune(..., attention=...)``, one row per attention role tried, in the order
    the tuner lowers them (the most accurate first): ``role``, ``rule`` tried, ``flops``,
    ``sqnr`` (the worst of out, dQ, dK, dV over the modules, dB), ``estimate`` and
    ``choice`` (the rule kept, or ``bf16``); none when attention was not tuned."""
    section = tuned.get("attention_tuning")
    if section is None:
        return []
    rows = []
    for role in section["order"]:
        figures = section["roles"][role]
        rows.append({
            "role": role,
            "rule": figures["rule"],
            "flops": format_flops(figures["flops"]),
            "sqnr": f"{_sqnr(_worst(figures['sqnr'].values()))} dB",
            "estimate": format_estimate(figures["loss_change_estimate"]),
            "choice": figures["rule"] if figures["chosen"] else "bf16",
        })  # fmt: skip
    return rows


def _worst(values: Any) -> float | None:
    """The lowest SQNR; a saved tuned.json spells infinities ``"inf"`` and NaN null."""
    numbers = [float(v) for v in values if v is not None]
    return min(numbers) if numbers else None


def attention_text(tuned: dict[str, Any]) -> str:
    """One sentence: the attention roles lowered and those kept in bf16, or why none."""
    section = tuned["attention_tuning"]
    roles = section["roles"]
    low = [r for r in section["order"] if roles[r]["chosen"]]
    kept = [r for r in section["order"] if not roles[r]["chosen"]]
    if not low:
        return f"Attention: no role lowered ({section['reason']})."
    rest = f"; {', '.join(kept)} in bf16" if kept else ""
    return f"Attention: {', '.join(low)} lowered ({section['chosen']}){rest}."


def source_text(tuned: dict[str, Any]) -> str:
    """Where the plan came from; when a rule won, how the estimate's own plan verified."""
    source = tuned.get("source", "estimate")  # tuned.json written before rule candidates
    if source == "estimate":
        return "The plan is the estimate's."
    estimate = tuned["verification"]["arms"]["estimate"]
    verdict = "within" if estimate["passed"] else "over"
    layers = estimate["layers"]
    low = sum(1 for f in layers.values() if f != "bf16")
    return (
        f"The plan is a first/last-N rule ({source}), trained as a candidate: the "
        f"estimate's own plan verified worse, {low}/{len(layers)} layers "
        f"({lowered_share(tuned, layers):.0%} of the GEMM FLOPs) at a gap of "
        f"{_number(estimate['gap'], '+.4f')}, {verdict} the budget."
    )


def rule_text(tuned: dict[str, Any]) -> str:
    """The rule arm's first/last-N rule, in words."""
    rule = tuned["rule"]
    if rule is None:
        return "rule: none trained (no first/last-N rule could beat the plan)"
    if rule["format"] is None:
        return "rule: every layer in bf16"
    return (
        f"rule: the first {rule['first']} and last {rule['last']} layers in bf16, the rest "
        f"in {rule['format']}"
    )


def _verdict(arm: dict[str, Any], name: str) -> str:
    """The plan passed or FAILED; the rule's gap is within the budget or over it."""
    if name == "bf16-mixed":
        return ""
    if not arm["completed"]:
        return "incomplete"
    if name == "plan":
        return "passed" if arm["passed"] else "FAILED"
    return "within" if arm["passed"] else "over"


def _number(value: float | None, spec: str = ".4f") -> str:
    """A loss figure; a dash for none (NaN is written to JSON as null), ``inf`` as such."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return DASH
    return format(value, spec) if math.isfinite(value) else str(value)


def verification_rows(tuned: dict[str, Any]) -> list[dict[str, str]]:
    """One row per arm: ``arm``, ``lowered`` (layers and FLOPs), ``seed N`` per seed
    (a dash where the run did not happen), ``mean``, ``std`` over seeds, ``gap`` to
    bf16-mixed and ``verdict`` (:func:`_verdict`)."""
    verification = tuned["verification"]
    rows = []
    for name, arm in verification["arms"].items():
        layers = arm["layers"]
        low = sum(1 for f in layers.values() if f != "bf16")
        row = {
            "arm": name,
            "lowered": f"{low}/{len(layers)} ({lowered_share(tuned, layers):.0%})",
            "formats": _format_counts(layers) + _roles_count(arm.get("attention")),
        }
        losses = list(arm["final_losses"])
        for index, seed in enumerate(verification["seeds"]):
            row[f"seed {seed}"] = _number(losses[index]) if index < len(losses) else DASH
        row |= {"mean": _number(arm["mean"]), "std": _number(arm["spread"]),
                "gap": _number(arm["gap"], "+.4f"), "verdict": _verdict(arm, name)}  # fmt: skip
        rows.append(row)
    return rows


def round_rows(tuned: dict[str, Any]) -> list[dict[str, str]]:
    """One row per verification round, in the order trained: ``round``, ``source``
    (``estimate`` or the rule), ``lowered`` (layers and FLOPs), ``formats`` (how many
    layers each format lowers, most first, then the attention roles lowered),
    ``estimate`` (summed),
    ``gap`` to bf16-mixed and ``verdict`` (``passed``, ``FAILED`` or ``incomplete``);
    ``chosen`` marks the plan kept."""
    rows = []
    for number, entry in enumerate(tuned["rounds"], start=1):
        layers = entry["layers"]
        low = sum(1 for f in layers.values() if f != "bf16")
        verdict = "passed" if entry["passed"] else "FAILED"
        attention = entry.get("attention")  # absent in tuned.json before attention tuning
        formats = _format_counts(layers) + _roles_count(attention)
        chosen = layers == tuned["layers"] and attention == _chosen_attention(tuned)
        rows.append({
            "round": str(number),
            "source": entry.get("source", "estimate"),
            "lowered": f"{low}/{len(layers)} ({lowered_share(tuned, layers):.0%})",
            "formats": formats,
            "estimate": format_estimate(entry["estimate"]),
            "gap": _number(entry["gap"], "+.4f"),
            "verdict": verdict if entry["completed"] else "incomplete",
            "chosen": "<- plan" if chosen else "",
        })  # fmt: skip
    return rows


def _roles_count(attention: str | None) -> str:
    """``, attention 5``: the attention roles a plan lowers (its config's spelling
    names each as ``role:rule``); empty for a plan without an attention config."""
    return "" if attention is None else f", attention {attention.count(':')}"


def _chosen_attention(tuned: dict[str, Any]) -> str | None:
    section = tuned.get("attention_tuning")
    return None if section is None else section["chosen"]


def _format_counts(layers: dict[str, str]) -> str:
    """``mxfp8 3, nvfp4 1``: the layers each low format takes, most first; ``-`` if none."""
    counts: dict[str, int] = {}
    for fmt in layers.values():
        if fmt != "bf16":
            counts[fmt] = counts.get(fmt, 0) + 1
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return ", ".join(f"{fmt} {count}" for fmt, count in ranked) or "-"
