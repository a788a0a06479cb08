"""The doctor's :class:`~amped.doctor.report.Report` as a page: ``doctor.html`` and its plot.

``Report.save_html`` and ``amped doctor`` write it. ``report`` is typed ``Any`` here:
importing :mod:`amped.doctor.report` back would make an import cycle with the method.

The plot draws each module's dynamic range (smallest non-zero and largest |value| its
ops produced) on a log2 axis against the dtype's limits, so a reader sees which layer
leaves the representable range. matplotlib's object API only: no global backend.
Without matplotlib the page says how to get the plot.
"""

from __future__ import annotations

import base64
import html
import math
import os
from pathlib import Path
from typing import Any

import torch

from amped._internal.errors import type_error
from amped._internal.files import write_files
from amped.doctor.stats import smallest_subnormal

__all__ = ["doctor_html", "doctor_plot_png", "save_doctor_html", "save_doctor_plot"]

Ranges = dict[str, tuple[float, float, bool]]  # module -> (min non-zero, max, any inf/NaN)


def module_ranges(report: Any) -> Ranges:
    """Per module: (smallest non-zero, largest finite |value|, any inf/NaN) of its ops."""
    ranges: Ranges = {}
    for op in report.ops:
        name = op.module or "<root>"
        lo, hi, bad = ranges.get(name, (math.inf, 0.0, False))
        lo = min(lo, op.amin) if op.amin > 0 else lo
        ranges[name] = (lo, max(hi, op.amax), bad or bool(op.n_inf or op.n_nan))
    return ranges


def doctor_plot_png(report: Any) -> bytes | None:
    """The dynamic-range plot as PNG bytes (None without matplotlib)."""
    try:
        from matplotlib.figure import Figure

        from amped.cli.plots import figure_png
    except ImportError:
        return None
    dtype = getattr(torch, report.dtype)
    top, bottom = torch.finfo(dtype).max, smallest_subnormal(dtype)
    ranges = module_ranges(report)
    names = [n for n, (_, hi, bad) in ranges.items() if hi > 0 or bad]
    figure = Figure(figsize=(9, 0.4 * len(names) + 2.2))
    axes = figure.add_subplot()
    lows, highs = [math.log2(bottom)], [math.log2(top)]
    for i, name in enumerate(names):
        lo, hi, bad = ranges[name]
        hi = hi if hi > 0 else top
        x0, x1 = math.log2(lo if math.isfinite(lo) else hi), math.log2(hi)
        lows.append(x0)
        highs.append(x1)
        color = "tab:red" if bad or hi > top else "tab:blue"
        axes.plot([x0, x1], [i, i], lw=7, color=color, solid_capstyle="butt")
        if bad:
            axes.annotate("inf/NaN", (math.log2(top), i), xytext=(4, -3),
                          textcoords="offset points", color="tab:red", fontsize=8)  # fmt: skip
    _draw_limits(axes, dtype, min(lows) - 4, max(highs) + 4)
    axes.set_ylim(-0.7, len(names) - 0.3)
    # Module names are the user's: "$" in one must not start matplotlib's mathtext.
    axes.set_yticks(range(len(names)), names, fontsize=8, parse_math=False)
    axes.set_xlabel("log2 |value| produced by the module's ops (red: overflow, inf or NaN)")
    axes.set_title(f"Dynamic range per module in the {report.dtype} run", pad=18)
    return figure_png(figure, dpi=100)


def _draw_limits(axes: Any, dtype: torch.dtype, left: float, right: float) -> None:
    """The dtype's max, min normal and min subnormal, with the ranges past them shaded."""
    info, name = torch.finfo(dtype), str(dtype).removeprefix("torch.")
    top, bottom = info.max, smallest_subnormal(dtype)
    for value, label in ((top, "max"), (info.tiny, "min normal"), (bottom, "min subnormal")):
        axes.axvline(math.log2(value), color="gray", lw=1, ls="--")
        axes.annotate(f"{name} {label}", (math.log2(value), 1.0),
                      xycoords=("data", "axes fraction"), xytext=(2, 2),
                      textcoords="offset points", fontsize=8)  # fmt: skip
    axes.axvspan(math.log2(top), right, color="tab:red", alpha=0.08)
    axes.axvspan(left, math.log2(bottom), color="tab:orange", alpha=0.08)
    axes.set_xlim(left, right)


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None or math.isnan(value) else format(value, spec)


def doctor_html(report: Any) -> str:
    """A self-contained HTML page: the summary, the plot and every op."""
    png = doctor_plot_png(report)
    plot = (
        f'<img alt="dynamic range per module" src="data:image/png;base64,'
        f'{base64.b64encode(png).decode()}">'
        if png is not None
        else "<p>(install matplotlib, from amped's clone: <code>pip install -e '.[cli]'</code>, "
        "for a plot)</p>"
    )
    rows = "".join(
        f"<tr><td>{o.index}</td><td>{html.escape(o.module or '<root>')}</td>"
        f"<td>{html.escape(o.op)}</td><td>{o.dtype}</td><td>{o.amax:.3g}</td>"
        f"<td>{o.n_inf}</td><td>{o.n_nan}</td><td>{_fmt(o.underflow, '.2%')}</td>"
        f"<td>{_fmt(o.sqnr_db, '.1f')}</td></tr>"
        for o in report.ops
    )
    return _PAGE.format(
        title=f"amped doctor: {report.dtype} on {report.device_type}",
        summary=html.escape(report.summary()),
        fix=_fix(report),
        plot=plot,
        rows=rows,
    )


def _fix(report: Any) -> str:
    """The verified fix as the code that applies it, ready to copy."""
    suggestion = report.suggestion
    if suggestion is None or not suggestion.verified or not suggestion.code:
        return ""
    return (
        f"<h2>Fix</h2><p>{html.escape(str(suggestion))}. Verified by re-running the step; "
        f"this builds it:</p><pre><code>import amped\n{html.escape(suggestion.code)}"
        "</code></pre>"
    )


def _check_report(report: object) -> None:
    # By its fields, not isinstance: Report.save_html imports this module, which must
    # not import amped.doctor.report back (no import cycle).
    if not all(hasattr(report, name) for name in ("ops", "dtype", "summary", "suggestion")):
        raise type_error(
            "The doctor's pages draw the Report amped.doctor.diagnose() returns",
            "report",
            report,
        )


def save_doctor_html(report: Any, path: str | os.PathLike[str]) -> Path:
    """Write :func:`doctor_html` to ``path`` atomically; returns the path."""
    _check_report(report)
    path = Path(path)
    write_files([(path, doctor_html(report))])
    return path


def save_doctor_plot(report: Any, path: str | Path) -> Path:
    """Write the dynamic-range plot to ``path`` as PNG, atomically (needs matplotlib)."""
    _check_report(report)
    png = doctor_plot_png(report)
    if png is None:
        raise ImportError("The plot needs matplotlib; from amped's clone: pip install -e '.[cli]'")
    path = Path(path)
    write_files([(path, png)])
    return path


_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>body{{font-family:sans-serif;margin:2em auto;max-width:1100px;padding:0 1em}}
pre{{background:#f4f4f4;padding:1em;white-space:pre-wrap;overflow-wrap:anywhere}}
img{{max-width:100%}}
table{{border-collapse:collapse;font-size:12px}}
td,th{{border:1px solid #ccc;padding:2px 6px}}</style>
</head><body><h1>{title}</h1><pre>{summary}</pre>{fix}{plot}
<h2>Ops</h2><table><tr><th>#</th><th>module</th><th>op</th><th>dtype</th><th>max |x|</th>
<th>inf</th><th>NaN</th><th>underflow</th><th>SQNR dB</th></tr>{rows}</table></body></html>
"""
