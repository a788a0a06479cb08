"""The speed targets on an H200, evaluated from the GPU check's benchmark figures.

Each target reads one figure from one part's JSON: a ratio against torch O1 from
``benchmarks/recipes.py`` (the worst model's, since the target must hold on each) or
the FP8 speed-up over bf16-mixed from ``benchmarks/fp8.py``'s GPU part (tensorwise,
the default FP8 recipe). A target whose part did not run or wrote no such figure is
``"not measured"``, with the reason.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

# name -> (part, what the figure is, comparison, target)
TARGETS = {
    "bf16_mixed_over_torch_o1": (
        "recipes",
        "amped bf16-mixed step time / torch O1 step time, worst model",
        "<=",
        1.01,
    ),
    "bf16_master_over_torch_o1": (
        "recipes",
        "bf16-master step time / torch O1 step time, worst model",
        "<=",
        0.97,
    ),
    "fp8_speedup_over_bf16": (
        "fp8",
        "bf16-mixed step time / fp8-tensorwise step time (fp8.py's GPU layers)",
        ">=",
        1.3,
    ),
}
COMPARE: dict[str, Callable[[float, float], bool]] = {"<=": operator.le, ">=": operator.ge}
FP8_RECIPE = "fp8-tensorwise"


def recipes_figure(section: dict, name: str) -> tuple[float | None, dict, str | None]:
    """The worst model's ratio for ``name`` (a key of recipes.py's ratios)."""
    models = (section.get("figures") or {}).get("models") or {}
    key = {"bf16_mixed_over_torch_o1": "amped bf16-mixed"}.get(name, "bf16-master")
    per_case = {model: figures["ratios"][key] for model, figures in models.items()}
    if not per_case:
        return None, {}, "recipes.py wrote no model figures"
    return max(per_case.values()), per_case, None


def fp8_figure(section: dict) -> tuple[float | None, dict, str | None]:
    gpu = (section.get("figures") or {}).get("gpu")
    if gpu is None:
        return None, {}, "fp8.py's GPU part did not run: no CUDA device of capability >= 8.9"
    per_case = {recipe: figures["speedup/bf16"] for recipe, figures in gpu.items()}
    if FP8_RECIPE not in per_case:
        return None, per_case, f"fp8.py measured no {FP8_RECIPE}"
    return per_case[FP8_RECIPE], per_case, None


def evaluate(report: dict) -> dict:
    """Every target: value, target, met (True, False or "not measured") and why not."""
    env = report.get("environment", {})
    if report.get("dry_run"):
        note = "dry run: CPU figures at the smallest sizes; the targets are for an H200"
    elif not env.get("gpu"):
        note = "no CUDA device"
    elif "H200" not in env["gpu"]:
        note = f"measured on {env.get('gpu')}; the targets are set for an H200"
    else:
        note = None
    out = {}
    for name, (part, what, compare, target) in TARGETS.items():
        section = report.get(part) or {}
        entry: dict = {"what": what, "target": target, "compare": compare, "note": note}
        if section.get("status") != "passed":
            value, per_case = None, {}
            reason = f"part {part!r} {section.get('status', 'not run yet')}"
        elif part == "recipes":
            value, per_case, reason = recipes_figure(section, name)
        else:
            value, per_case, reason = fp8_figure(section)
        met = "not measured" if value is None else COMPARE[compare](value, target)
        out[name] = {**entry, "value": value, "met": met, "reason": reason, "per_case": per_case}
    return out
