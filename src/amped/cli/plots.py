"""The report's plots, drawn from the ``results.json`` document as PNG bytes.

matplotlib's object API only (``Figure``, no ``pyplot``): no global state, no GUI
backend, safe in a headless process. Each recipe keeps one colour in every plot.
"""

from __future__ import annotations

import io
import math
from typing import Any

from matplotlib.figure import Figure

__all__ = ["PLOTS", "figure_png", "render_all", "smoothing_window"]

_PALETTE = ("#222222", "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
            "#e377c2", "#17becf", "#bcbd22")  # fmt: skip
_DPI = 110
_STATE_PARTS = (
    ("params_bytes", "parameters"),
    ("grads_bytes", "gradients"),
    ("optimizer_state_bytes", "optimizer state"),
    ("masters_bytes", "master copies"),
)


_LINESTYLES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">")


def _colours(results: dict[str, Any]) -> dict[str, str]:
    return {r["name"]: _PALETTE[i % len(_PALETTE)] for i, r in enumerate(results["recipes"])}


def _styles(results: dict[str, Any], points: int) -> dict[str, dict[str, Any]]:
    """Per recipe: colour, dash pattern and marker, the markers staggered along the x axis.

    Recipes whose curves coincide exactly still show: each has its own dash pattern,
    and its markers sit at other steps than the others' (``markevery`` offsets).
    """
    names = [r["name"] for r in results["recipes"]]
    colours = _colours(results)
    every = max(1, points // 8)
    return {
        name: {
            "color": colours[name],
            "linestyle": _LINESTYLES[i % len(_LINESTYLES)],
            "marker": _MARKERS[i % len(_MARKERS)],
            "markevery": (min(i * every // max(len(names), 1), max(points - 1, 0)), every),
            "markersize": 4,
        }
        for i, name in enumerate(names)
    }


def _same_as(results: dict[str, Any], key: str) -> dict[str, str]:
    """For a recipe whose ``key`` list equals an earlier recipe's, that recipe's name."""
    first: dict[tuple[Any, ...], str] = {}
    same: dict[str, str] = {}
    for run in results["recipes"]:
        values = tuple(run.get(key) or ())
        if not values:
            continue
        if values in first:
            same[run["name"]] = first[values]
        else:
            first[values] = run["name"]
    return same


def _label(name: str, same: dict[str, str]) -> str:
    return f"{name} (= {same[name]})" if name in same else name


def figure_png(figure: Figure, dpi: int = _DPI) -> bytes:
    """``figure`` as PNG bytes, laid out tight unless it has a layout engine."""
    if figure.get_layout_engine() is None:
        figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def smoothing_window(points: int) -> int:
    """Steps in the centred moving average of a ``points``-step curve: about 5% of the
    run, odd; 1 (no smoothing) below 40 steps."""
    return 2 * (points // 40) + 1


def _smooth(values: list[float | None]) -> list[float]:
    """Centred moving average over :func:`smoothing_window` steps (no lag, unlike an
    EMA); the window shrinks at the ends, and gaps (None, non-finite) are skipped."""
    half = smoothing_window(len(values)) // 2
    finite = [v if v is not None and math.isfinite(v) else None for v in values]
    out = []
    for i in range(len(finite)):
        window = [v for v in finite[max(i - half, 0) : i + half + 1] if v is not None]
        out.append(sum(window) / len(window) if window else math.nan)
    return out


def _smoothed_what(points: int) -> str:
    window = smoothing_window(points)
    if window == 1:
        return "every step, unsmoothed"
    return f"thin: every step; bold: centred mean of {window} steps"


def loss_curves(results: dict[str, Any]) -> bytes | None:
    """Train loss per step for every recipe (the raw series thin, and from 40 steps on
    a centred moving average bold; the title says which), and each recipe's difference
    to fp32's loss on the same batches, smoothed the same way."""
    runs = [r for r in results["recipes"] if r["losses"]]
    if not runs:
        return None
    colours = _colours(results)
    points = max(len(r["losses"]) for r in runs)
    styles = _styles(results, points)
    same = _same_as(results, "losses")
    base = next((r for r in runs if r["name"] == results["baseline"]), None)
    smoothed = smoothing_window(points) > 1
    figure = Figure(figsize=(8, 6.4 if base else 4.2), layout="constrained")  # keeps labels in
    axes, gap = figure.subplots(2, 1, sharex=True, height_ratios=(3, 2)) if base else (
        figure.add_subplot(), None)  # fmt: skip
    if gap is not None and base is not None:
        _loss_gap(gap, runs, base, styles, points)
    for run in runs:
        steps = range(1, len(run["losses"]) + 1)
        raw = [math.nan if v is None else v for v in run["losses"]]
        label = _label(run["name"], same)
        if smoothed:
            axes.plot(steps, raw, color=colours[run["name"]], alpha=0.35, linewidth=0.8)
            axes.plot(steps, _smooth(run["losses"]), label=label, **styles[run["name"]])
        else:
            axes.plot(steps, raw, label=label, **styles[run["name"]])
    common = results.get("common_step")
    if common and any(len(r["losses"]) > common for r in runs):
        axes.axvline(common, color="#888888", linestyle=":", linewidth=1)
    title = f"Train loss, same batches for every recipe\n{_smoothed_what(points)}"
    if same:
        title += "; (= x): identical to x at every step"
    axes.set(ylabel="train loss", title=title)
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small", ncol=2)
    (gap if gap is not None else axes).set_xlabel("step")
    return figure_png(figure)


def _loss_gap(
    axes: Any, runs: list[dict[str, Any]], base: dict[str, Any], styles: Any, points: int
) -> None:
    """``loss - fp32 loss`` per step, smoothed as the curves above: they overlap when
    it is small."""
    reference = base["losses"]
    for run in runs:
        if run is base:
            continue
        pairs = zip(run["losses"], reference, strict=False)
        diff = [None if a is None or b is None else a - b for a, b in pairs]
        axes.plot(range(1, len(diff) + 1), _smooth(diff), **styles[run["name"]])
    axes.axhline(0.0, color=styles[base["name"]]["color"], linewidth=1)
    window = smoothing_window(points)
    what = "every step" if window == 1 else f"centred mean of {window} steps"
    axes.set(ylabel="loss − fp32 loss", title=f"Difference to fp32 ({what})")
    axes.grid(alpha=0.3)


def loss_scale(results: dict[str, Any]) -> bytes | None:
    """The loss scale at every step of the recipes that scale the loss (log2 axis)."""
    runs = [r for r in results["recipes"] if r["loss_scales"]]
    if not runs:
        return None
    styles = _styles(results, max(len(r["loss_scales"]) for r in runs))
    same = _same_as({"recipes": runs}, "loss_scales")
    figure = Figure(figsize=(8, 3.4))
    axes = figure.add_subplot()
    for run in runs:
        scales = run["loss_scales"]
        label = f"{_label(run['name'], same)}: {run['skipped_steps']} skipped"
        axes.step(range(1, len(scales) + 1), scales, where="post", label=label,
                  linewidth=2.5 if run["name"] not in same else 1.2,
                  **styles[run["name"]])  # fmt: skip
    axes.set_yscale("log", base=2)
    axes.set(xlabel="step", ylabel="loss scale", title="Dynamic loss scale")
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    return figure_png(figure)


def throughput(results: dict[str, Any]) -> bytes | None:
    """Samples per second per recipe, labelled with the ratio to fp32."""
    runs = [r for r in results["recipes"] if r["samples_per_s"]]
    if not runs:
        return None
    colours = _colours(results)
    figure = Figure(figsize=(8, 0.5 * len(runs) + 1.3))
    axes = figure.add_subplot()
    names = [r["name"] for r in runs][::-1]
    speeds = [r["samples_per_s"] for r in runs][::-1]
    spreads = [r.get("samples_per_s_iqr") for r in runs][::-1]
    errors = [
        [max(v - p[0], 0.0) if p else 0.0 for v, p in zip(speeds, spreads, strict=True)],
        [max(p[1] - v, 0.0) if p else 0.0 for v, p in zip(speeds, spreads, strict=True)],
    ]
    bars = axes.barh(names, speeds, color=[colours[n] for n in names], xerr=errors,
                     error_kw={"ecolor": "#555555", "capsize": 3})  # fmt: skip
    for bar, run in zip(bars, runs[::-1], strict=True):
        if run["slow_on_this_hardware"]:
            bar.set_hatch("//")
        ratio = run["throughput_vs_baseline"]
        iqr = run.get("samples_per_s_iqr")
        label = f" {run['samples_per_s']:,.0f}" + (
            f" (IQR {iqr[0]:,.0f}–{iqr[1]:,.0f})" if iqr else ""
        )
        label += f"  {ratio:.2f}× fp32" if ratio else ""
        end = max(bar.get_width(), iqr[1] if iqr else 0.0)  # after the whisker, not on it
        axes.text(end, bar.get_y() + bar.get_height() / 2, label, va="center",
                  fontsize="small")  # fmt: skip
    highest = max(max(p[1] for p in spreads if p) if any(spreads) else 0.0, max(speeds))
    axes.set_xlim(0, highest * 1.45)
    speed = results.get("speed") or {}
    title = "Throughput (hatched: slow on this hardware)"
    if speed.get("reason"):
        title = "Throughput (too few timed steps to compare speed: no ratios)"
    axes.set(xlabel="samples / s (median step; whiskers: interquartile range)", title=title)
    axes.grid(axis="x", alpha=0.3)
    return figure_png(figure)


def memory(results: dict[str, Any]) -> bytes | None:
    """Training-state bytes per parameter by kind, and each recipe's peak memory."""
    runs = [r for r in results["recipes"] if r["memory"]]
    if not runs:
        return None
    figure = Figure(figsize=(8, 0.5 * len(runs) + 2.3))
    state, peak = figure.subplots(1, 2, sharey=True)
    names = [r["name"] for r in runs][::-1]
    left = [0.0] * len(runs)
    for (key, label), shade in zip(_STATE_PARTS, ("#4c72b0", "#55a868", "#c44e52", "#8172b2"),
                                   strict=True):  # fmt: skip
        per_param = [r["memory"][key] / max(r["memory"]["param_count"], 1) for r in runs][::-1]
        state.barh(names, per_param, left=left, color=shade, label=label)
        left = [a + b for a, b in zip(left, per_param, strict=True)]
    state.set(xlabel="bytes per parameter", title="Training state")
    state.legend(fontsize="x-small", loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2)
    colours = _colours(results)
    peaks = [(r["memory"]["peak_bytes"] or 0) / 2**20 for r in runs][::-1]
    peak.barh(names, peaks, color=[colours[n] for n in names])
    kind = runs[0]["memory"]["peak_kind"]
    titles = {
        "cuda_allocator_peak": "Peak allocator",
        "own_process_peak_rss": "Peak RSS, own process",
    }
    peak.set(xlabel="MiB", title=titles.get(kind, "Peak RSS growth"))
    for axes in (state, peak):
        axes.grid(axis="x", alpha=0.3)
    return figure_png(figure)


PLOTS = (
    ("loss", "Loss curves", loss_curves),
    ("loss_scale", "Loss scale", loss_scale),
    ("throughput", "Throughput", throughput),
    ("memory", "Memory", memory),
)


def render_all(results: dict[str, Any]) -> dict[str, bytes | None]:
    """Every plot by key; None where the results hold nothing to draw."""
    return {key: draw(results) for key, _, draw in PLOTS}
