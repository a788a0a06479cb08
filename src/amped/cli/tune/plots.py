"""The tune report's per-layer chart, drawn from the ``tuned.json`` document as PNG bytes.

Layers run along the x axis in model order. The top panel is each candidate format's
estimated loss change (log scale), the middle one its output SQNR in dB; the chosen
format's point is ringed in both. The bottom strip names the choice for each layer.
matplotlib's object API only, as :mod:`amped.cli.plots`.
"""

from __future__ import annotations

import math
from typing import Any

from matplotlib.figure import Figure

from amped.cli.plots import figure_png
from amped.tuning.summary import candidate_formats

__all__ = ["BF16_COLOUR", "format_colours", "sensitivity_chart"]

BF16_COLOUR = "#9a9a9a"
_PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
            "#17becf")  # fmt: skip
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_LABEL = 32  # characters of a layer name on the x axis: its end, which says which layer


def format_colours(tuned: dict[str, Any]) -> dict[str, str]:
    """One colour per candidate format (in the tuner's order), grey for bf16."""
    formats = candidate_formats(tuned)
    return {"bf16": BF16_COLOUR} | {f: _PALETTE[i % len(_PALETTE)] for i, f in enumerate(formats)}


def _positive(value: float | None) -> float:
    """A value a log axis can show; NaN (no point) for None, zero or negative."""
    return value if value is not None and value > 0 and math.isfinite(value) else math.nan


def _finite(value: float | None) -> float:
    return value if value is not None and math.isfinite(value) else math.nan


def sensitivity_chart(tuned: dict[str, Any]) -> bytes | None:
    """Per layer and format: estimated loss change and output SQNR, with the choice
    ringed and named; None when no layer was measured."""
    names = list(tuned["measurements"])
    if not names:
        return None
    formats = candidate_formats(tuned)
    colours = format_colours(tuned)
    width = min(18.0, max(9.5, 0.42 * len(names) + 4.0))  # room for the legend
    figure = Figure(figsize=(width, 7.8), layout="constrained")
    estimate, sqnr, strip = figure.subplots(3, 1, sharex=True, height_ratios=(5, 4, 1.6))
    offsets = _offsets(formats)
    for index, fmt in enumerate(formats):
        x = [i + offsets[fmt] for i in range(len(names))]
        figures = [tuned["measurements"][n]["formats"].get(fmt) or {} for n in names]
        style = {"color": colours[fmt], "marker": _MARKERS[index % len(_MARKERS)],
                 "markersize": 5, "linewidth": 1.2}  # fmt: skip
        estimate.plot(x, [_positive(f.get("loss_change_estimate")) for f in figures],
                      label=fmt, **style)  # fmt: skip
        sqnr.plot(x, [_finite(f.get("sqnr_output")) for f in figures], **style)
    _ring_choices(tuned, names, estimate, sqnr, offsets)
    values = [
        _positive(f.get("loss_change_estimate"))
        for n in names
        for f in tuned["measurements"][n]["formats"].values()
    ]
    if any(v == v for v in values):  # a log axis needs a positive value (NaN != NaN)
        estimate.set_yscale("log")
    budget = tuned["budget"]["value"]
    if budget and budget > 0 and math.isfinite(budget):
        estimate.axhline(budget, color="#555555", linestyle="--", linewidth=1,
                         label=f"budget {budget:.1e} (whole plan)")  # fmt: skip
    estimate.set(ylabel="estimated loss change",
                 title="Sensitivity per layer and format (ringed: the format chosen)")  # fmt: skip
    estimate.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    sqnr.set(ylabel="output SQNR (dB)")
    for axes in (estimate, sqnr):
        axes.grid(alpha=0.3)
    _choice_strip(strip, tuned, names, colours)
    return figure_png(figure)


def _offsets(formats: list[str]) -> dict[str, float]:
    """Each format's points a little to the side of the layer's position, so that
    formats with equal figures (the same SQNR, say) sit side by side, not on top of
    each other, the chosen one hidden."""
    step = min(0.12, 0.6 / max(len(formats), 1))
    return {fmt: (index - (len(formats) - 1) / 2) * step for index, fmt in enumerate(formats)}


def _ring_choices(
    tuned: dict[str, Any], names: list[str], estimate: Any, sqnr: Any, offsets: dict[str, float]
) -> None:
    """A hollow black ring around the chosen format's point in both panels."""
    ringed = [(i, tuned["layers"].get(n, "bf16")) for i, n in enumerate(names)]
    points = [(i + offsets.get(f, 0.0), tuned["measurements"][names[i]]["formats"].get(f))
              for i, f in ringed]  # fmt: skip
    chosen = [(i, f) for i, f in points if f is not None]
    ring = {"s": 130, "facecolors": "none", "edgecolors": "black", "linewidths": 1.4, "zorder": 5}
    x = [i for i, _ in chosen]
    estimate.scatter(x, [_positive(f.get("loss_change_estimate")) for _, f in chosen], **ring)
    sqnr.scatter(x, [_finite(f.get("sqnr_output")) for _, f in chosen], **ring)


def _choice_strip(
    axes: Any, tuned: dict[str, Any], names: list[str], colours: dict[str, str]
) -> None:
    """One coloured cell per layer, named by the format chosen for it (the name turned
    upright when the cells are narrow)."""
    few = len(names) <= 10
    for i, name in enumerate(names):
        fmt = tuned["layers"].get(name, "bf16")
        axes.bar(i, 1.0, width=0.94, color=colours.get(fmt, BF16_COLOUR))
        axes.text(i, 0.5, fmt, ha="center", va="center", rotation=0 if few else 90,
                  fontsize="x-small", color="white" if fmt != "bf16" else "black")  # fmt: skip
    axes.set_yticks([])
    axes.set_ylim(0, 1)
    axes.set_ylabel("choice", rotation=0, ha="right", va="center")
    # Module names are the user's: "$" in one must not start matplotlib's mathtext.
    labels = [n if len(n) <= _LABEL else "…" + n[-(_LABEL - 1) :] for n in names]
    axes.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize="small",
                    parse_math=False)  # fmt: skip
    axes.set_xlim(-0.6, len(names) - 0.4)
