"""The choice: the per-layer plan that saves the most GEMM time within a loss budget, and
the best first/last-N rule it is compared with (docs/tune.md, "How it chooses").

A layer in format ``f`` saves ``flops * (1 - 1 / speedup[f])`` of bfloat16 GEMM time
(``speedup`` from :data:`SPEEDUPS`, per target device) and costs its measured
``loss_change_estimate``. The plan maximises the summed saving with the summed cost at
most the budget: a multiple-choice knapsack, solved exactly by dynamic programming over
the costs rounded *up* to ``budget / RESOLUTION`` (so the plan never exceeds the budget;
it may miss a plan within ``layers * budget / RESOLUTION`` of it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from amped._internal.errors import value_error
from amped.tuning.measure import LayerMeasurement

__all__ = ["RESOLUTION", "SPEEDUPS", "Choice", "best_rule", "choose_plan", "speedups"]

RESOLUTION = 1000
"""Cost units per budget in the knapsack."""

SPEEDUPS: dict[str, dict[str, float]] = {
    # NVIDIA B200 datasheet, dense tensor-core throughput: BF16 2.25, FP8/MXFP8 4.5,
    # FP4 (MXFP4/NVFP4) 9 PFLOP/s.
    "blackwell": {
        "bf16": 1.0,
        "fp8-tensorwise": 2.0,
        "fp8-rowwise": 2.0,
        "fp8-rowwise-gw-hp": 5 / 3,  # one of its three GEMMs (grad_weight) stays bf16
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


def _options(m: LayerMeasurement, speed: dict[str, float]) -> list[tuple[str, float, float]]:
    """(format, cost, saving) of the formats worth choosing for ``m``: a finite cost and
    a positive saving."""
    options = []
    for fmt, fm in m.formats.items():
        saving = m.flops * (1.0 - 1.0 / speed[fmt])
        if saving > 0 and math.isfinite(fm.loss_change_estimate):
            options.append((fmt, fm.loss_change_estimate, saving))
    return options


def _units(cost: float, budget: float) -> int:
    if cost == 0:
        return 0
    if budget == 0:
        return RESOLUTION + 1  # never fits
    return math.ceil(cost / budget * RESOLUTION)


def choose_plan(measured: list[LayerMeasurement], budget: float, target: str) -> Choice:
    """The knapsack's plan (see the module docstring). Ties keep bfloat16."""
    speed = speedups(target)
    best = [0.0] * (RESOLUTION + 1)  # best[c]: most saving with at most c units
    picks: list[list[int]] = []  # per layer, per capacity: option index, -1 for bf16
    options = [_options(m, speed) for m in measured]
    for layer_options in options:
        new, pick = list(best), [-1] * (RESOLUTION + 1)
        for index, (_, cost, saving) in enumerate(layer_options):
            units = _units(cost, budget)
            for c in range(units, RESOLUTION + 1):
                if best[c - units] + saving > new[c]:
                    new[c], pick[c] = best[c - units] + saving, index
        best = new
        picks.append(pick)
    layers, capacity = {}, RESOLUTION
    for m, layer_options, pick in reversed(list(zip(measured, options, picks, strict=True))):
        index = pick[capacity]
        if index < 0:
            layers[m.name] = "bf16"
        else:
            fmt, cost, _ = layer_options[index]
            layers[m.name] = fmt
            capacity -= _units(cost, budget)
    ordered = {m.name: layers[m.name] for m in measured}
    return _summed(measured, ordered, speed)


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


def best_rule(measured: list[LayerMeasurement], budget: float, target: str) -> Choice:
    """The best "first N and last M layers in bf16, the rest in one format" rule within
    the budget, by the same estimate and saving. Layers the format cannot run stay bf16.
    Ties: the smaller estimate, then the formats' order, then smaller N, then smaller M."""
    speed = speedups(target)
    count = len(measured)
    formats = list(dict.fromkeys(f for m in measured for f in m.formats))
    allowed = [{f for f, _, _ in _options(m, speed)} for m in measured]
    best: Choice | None = None
    for fmt in formats:
        for first in range(count + 1):
            for last in range(count - first + 1):
                layers = {m.name: "bf16" for m in measured}
                for index in range(first, count - last):
                    if fmt in allowed[index]:
                        layers[measured[index].name] = fmt
                choice = _summed(measured, layers, speed, first=first, last=last, format=fmt)
                if choice.estimate > budget:
                    continue
                if best is None or (choice.saving, -choice.estimate) > (
                    best.saving,
                    -best.estimate,
                ):
                    best = choice
    if best is None:  # no format, or nothing fits: everything in bf16
        layers = {m.name: "bf16" for m in measured}
        best = _summed(measured, layers, speed, first=count, last=0, format=None)
    return best
