"""The choice: the per-layer plan that saves the most GEMM time within a loss budget, and
the best first/last-N rule it is compared with (docs/tune.md, "How it chooses").

A layer in format ``f`` saves ``flops * (1 - 1 / speedup[f])`` of bfloat16 GEMM time
(``speedup`` from :data:`SPEEDUPS`, per target device) and costs its measured
``loss_change_estimate``. :func:`plan_path` orders the plans by the estimate, from
all-bfloat16 to everything lowered, each the most saving for its summed estimate;
:func:`within` finds the last one within a budget (the tuner's first plan; its
verification rounds move along the path, docs/tune.md, "How it verifies").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from amped._internal.errors import value_error
from amped.lowp.attention_config import AttentionConfig
from amped.tuning.measure import LayerMeasurement

__all__ = [
    "SPEEDUPS",
    "Choice",
    "plan_path",
    "rule_plans",
    "speedups",
    "within",
]

SPEEDUPS: dict[str, dict[str, float]] = {
    # NVIDIA B200 datasheet, dense tensor-core throughput: BF16 2.25, FP8/MXFP8 4.5,
    # FP4 (MXFP4/NVFP4) 9 PFLOP/s.
    "blackwell": {
        "bf16": 1.0,
        "fp8-tensorwise": 2.0,
        "fp8-rowwise": 2.0,
        "fp8-rowwise-gw-hp": 5 / 3,  # one of its three GEMMs (grad_weight) stays bf16
        "fp8-blockwise": 2.0,  # FP8 tensor cores; the per-block scaling is not counted
        "mxfp8": 2.0,
        "mxfp4": 4.0,
        "nvfp4": 4.0,
    },
    # NVIDIA H100 SXM datasheet: BF16 989, FP8 1979 TFLOP/s dense; no MX or FP4 tensor
    # cores (block formats run no faster than bf16, so they are never chosen).
    "hopper": {
        "bf16": 1.0,
        "fp8-tensorwise": 2.0,
        "fp8-rowwise": 2.0,
        "fp8-rowwise-gw-hp": 5 / 3,
        "fp8-blockwise": 2.0,
        "mxfp8": 1.0,
        "mxfp4": 1.0,
        "nvfp4": 1.0,
    },
}
"""GEMM speed of each format relative to bfloat16, per target device."""


def speedups(target: str) -> dict[str, float]:
    """The :data:`SPEEDUPS` row of ``target`` (ValueError naming the known ones)."""
    if target not in SPEEDUPS:
        raise value_error(f"target is one of {', '.join(SPEEDUPS)}", "target", target)
    return SPEEDUPS[target]


@dataclass(frozen=True)
class Choice:
    """Formats per layer (``"bf16"`` where the layer stays), with the summed estimated
    loss change (``estimate``) and GEMM time saved in bf16-FLOP units (``saving``)."""

    layers: dict[str, str]
    estimate: float
    saving: float
    first: int | None = None  # for a rule: the first N eligible layers kept in bf16
    last: int | None = None  # and the last M
    format: str | None = None  # and the one format the rest run in
    attention: AttentionConfig | None = None  # the attention roles lowered (None: as it is)


def _options(m: LayerMeasurement, speed: dict[str, float]) -> list[tuple[str, float, float]]:
    """(format, cost, saving) of the formats worth choosing for ``m``: a finite cost and
    a positive saving."""
    options = []
    for fmt, fm in m.formats.items():
        saving = m.flops * (1.0 - 1.0 / speed[fmt])
        if saving > 0 and math.isfinite(fm.loss_change_estimate):
            options.append((fmt, fm.loss_change_estimate, saving))
    return options


def _hull(options: list[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    """The options on the upper concave hull of saving against cost, from bfloat16
    (cost 0, saving 0) on: each next one is the steepest step up in saving per cost
    (ties: the larger saving); dominated options drop out."""
    hull: list[tuple[str, float, float]] = []
    cost, saving = 0.0, 0.0
    while True:
        best: tuple[float, float, tuple[str, float, float]] | None = None
        for option in options:
            _, c, s = option
            if s <= saving or c < cost:
                continue
            slope = math.inf if c == cost else (s - saving) / (c - cost)
            if best is None or (slope, s) > (best[0], best[1]):
                best = (slope, s, option)
        if best is None:
            return hull
        hull.append(best[2])
        _, cost, saving = best[2]


def plan_path(measured: list[LayerMeasurement], target: str) -> list[Choice]:
    """The estimate's order of plans: from all-bfloat16 to every layer in its
    fastest format, one layer lowered (or moved to a faster format) per step, the step
    with the most saving per estimated loss change first (ties: model order).

    Each plan contains the one before it, and saves the most any plan can for its summed
    estimate (the steps follow each layer's concave hull in order of falling saving per
    cost, so every prefix is the exact knapsack optimum at its own cost). ``path[0]`` is
    all-bf16.
    """
    speed = speedups(target)
    steps: list[tuple[float, int, str]] = []  # (saving per cost, layer index, format)
    for index, m in enumerate(measured):
        cost = saving = 0.0
        for fmt, c, s in _hull(_options(m, speed)):
            slope = math.inf if c == cost else (s - saving) / (c - cost)
            steps.append((slope, index, fmt))
            cost, saving = c, s
    steps.sort(key=lambda step: (-step[0], step[1]))  # stable: a layer's steps stay in order
    layers = {m.name: "bf16" for m in measured}
    path = [_summed(measured, dict(layers), speed)]
    for _, index, fmt in steps:
        layers[measured[index].name] = fmt
        path.append(_summed(measured, dict(layers), speed))
    return path


def within(path: list[Choice], budget: float) -> int:
    """The index of the last plan on ``path`` whose summed estimate is within ``budget``
    (0, all-bf16, when none is)."""
    return max((i for i, choice in enumerate(path) if choice.estimate <= budget), default=0)


def _summed(
    measured: list[LayerMeasurement],
    layers: dict[str, str],
    speed: dict[str, float],
    **rule: object,
) -> Choice:
    estimate = saving = 0.0
    for m in measured:
        fmt = layers[m.name]
        if fmt != "bf16":
            estimate += m.formats[fmt].loss_change_estimate
            saving += m.flops * (1.0 - 1.0 / speed[fmt])
    return Choice(layers, estimate, saving, **rule)  # type: ignore[arg-type]


def rule_plans(measured: list[LayerMeasurement], target: str) -> list[Choice]:
    """Every distinct "first N and last M layers in bf16, the rest in one format" rule
    that lowers at least one layer (layers the format cannot run stay bf16), in the
    estimate's order: the smallest summed estimate first (ties: the larger saving, then
    the formats' order, smaller N, smaller M). Two rules lowering the same layers are one
    (the first in that order). These are the verification's rule candidates
    (:func:`amped.tuning.search.search_rules`)."""
    speed = speedups(target)
    count = len(measured)
    formats = list(dict.fromkeys(f for m in measured for f in m.formats))
    allowed = [{f for f, _, _ in _options(m, speed)} for m in measured]
    rules: list[Choice] = []
    for fmt in formats:
        for first in range(count + 1):
            for last in range(count - first + 1):
                layers = {m.name: "bf16" for m in measured}
                for index in range(first, count - last):
                    if fmt in allowed[index]:
                        layers[measured[index].name] = fmt
                if any(f != "bf16" for f in layers.values()):
                    rules.append(
                        _summed(measured, layers, speed, first=first, last=last, format=fmt)
                    )
    rules.sort(key=lambda rule: (rule.estimate, -rule.saving))  # stable: format, N, M
    distinct: dict[tuple[tuple[str, str], ...], Choice] = {}
    for rule in rules:
        distinct.setdefault(tuple(rule.layers.items()), rule)
    return list(distinct.values())
