"""The doctor's report: data, a plain-text summary, JSON, and an HTML page with a plot.

The plot (matplotlib, from the ``cli`` extra) draws each module's dynamic range —
the smallest non-zero and the largest |value| its ops produced — on a log2 axis
against the limits of float16 and bfloat16, so a reader sees which layer leaves the
representable range.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from amped.doctor.gradients import GradientCheck
from amped.doctor.stats import limits
from amped.policy import Policy

__all__ = ["Culprit", "OpStat", "Report", "Suggestion"]


@dataclass(frozen=True)
class OpStat:
    """One op call of the low-precision run, compared with the same call in float32."""

    index: int
    module: str
    op: str
    dtype: str
    amax: float
    amin: float
    n_inf: int
    n_nan: int
    underflow: float | None  # fraction of float32 non-zeros that are zero/subnormal here
    rel_error: float | None
    sqnr_db: float | None


@dataclass(frozen=True)
class Culprit:
    """The first op that produced a non-finite value."""

    phase: str  # "forward" or "backward"
    module: str
    op: str
    index: int
    source: str | None
    detail: str

    def __str__(self) -> str:
        where = f" at {self.source}" if self.source else ""
        return f"{self.phase}: {self.op} in {self.module or '<root>'}{where} ({self.detail})"


@dataclass(frozen=True)
class Suggestion:
    """A fix the doctor re-ran: a policy (pass it to autocast) and/or a loss scale."""

    description: str
    policy: Policy | None
    loss_scale: float | None
    verified: bool
    sqnr_db: float  # model output against float32 with the fix

    def __str__(self) -> str:
        if not self.verified:
            return f"not found: {self.description}"
        error = (
            "identical to float32" if self.sqnr_db == math.inf else f"{self.sqnr_db:.1f} dB SQNR"
        )
        return f"{self.description}: no overflow, error {error} vs float32"


@dataclass
class Report:
    """Everything :func:`amped.doctor.diagnose` found. ``healthy`` says whether all is well."""

    device_type: str
    dtype: str
    loss_scale: float
    policy: Policy
    ops: list[OpStat]
    forward_culprit: Culprit | None
    backward_culprit: Culprit | None
    gradients: list[GradientCheck]
    nonfinite_grads: dict[str, int]
    recommended_scale: float | None
    loss_reference: float
    loss_target: float
    sqnr_db: float
    suggestion: Suggestion | None = field(default=None)

    @property
    def healthy(self) -> bool:
        from amped.doctor.diagnose import UNDERFLOW_WARN

        return (
            self.forward_culprit is None
            and self.backward_culprit is None
            and not any(self.nonfinite_grads.values())
            and all(g.underflow <= UNDERFLOW_WARN and not g.overflows for g in self.gradients)
        )

    # --- data ------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        data = {
            "device_type": self.device_type,
            "dtype": self.dtype,
            "loss_scale": self.loss_scale,
            "policy": self.policy.name,
            "healthy": self.healthy,
            "loss": {"float32": self.loss_reference, self.dtype: self.loss_target},
            "output_sqnr_db": self.sqnr_db,
            "forward_culprit": asdict(self.forward_culprit) if self.forward_culprit else None,
            "backward_culprit": asdict(self.backward_culprit) if self.backward_culprit else None,
            "recommended_scale": self.recommended_scale,
            "gradients": [asdict(g) for g in self.gradients],
            "nonfinite_grads": self.nonfinite_grads,
            "ops": [asdict(o) for o in self.ops],
            "suggestion": None,
        }
        if self.suggestion is not None:
            data["suggestion"] = {
                "description": self.suggestion.description,
                "policy": str(self.suggestion.policy) if self.suggestion.policy else None,
                "loss_scale": self.suggestion.loss_scale,
                "verified": self.suggestion.verified,
                "sqnr_db": self.suggestion.sqnr_db,
            }
        return _finite_json(data)

    def to_json(self, indent: int = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    # --- text ------------------------------------------------------------------------

    def summary(self) -> str:
        """A few lines for a terminal or a log."""
        # bfloat16 has float32's exponent range: no loss scale to report unless one was set.
        scaled = self.dtype == "float16" or self.loss_scale != 1
        scale = f", loss scale {self.loss_scale:g}" if scaled else ""
        lines = [
            f"amped doctor: {self.dtype} on {self.device_type}{scale}, policy {self.policy.name!r}",
            f"  loss float32 {self.loss_reference:.6g}  {self.dtype} {self.loss_target:.6g}  "
            f"output SQNR {self.sqnr_db:.1f} dB",
        ]
        if self.healthy:
            lines.append("  healthy: no inf/NaN, no gradient underflow above 1%")
        for culprit in (self.forward_culprit, self.backward_culprit):
            if culprit is not None:
                lines.append(f"  first non-finite value, {culprit}")
        lossy = [g for g in self.gradients if g.underflow > 0]
        for g in sorted(lossy, key=lambda g: -g.underflow)[:5]:
            lines.append(
                f"  gradient {g.name}: {g.underflow:.1%} underflow at scale {g.scale:g} "
                f"(kept from scale {g.min_scale:g})"
            )
        if self.recommended_scale is not None and self.dtype == "float16":
            lines.append(f"  largest safe loss scale: {self.recommended_scale:g}")
        if self.suggestion is not None:
            lines.append(f"  suggestion: {self.suggestion}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    # --- HTML --------------------------------------------------------------------------

    def module_ranges(self) -> dict[str, tuple[float, float, bool]]:
        """Per module: (smallest non-zero, largest finite |value|, any inf/NaN) of its ops."""
        ranges: dict[str, tuple[float, float, bool]] = {}
        for op in self.ops:
            name = op.module or "<root>"
            lo, hi, bad = ranges.get(name, (math.inf, 0.0, False))
            lo = min(lo, op.amin) if op.amin > 0 else lo
            ranges[name] = (lo, max(hi, op.amax), bad or bool(op.n_inf or op.n_nan))
        return ranges

    def plot_png(self) -> bytes | None:
        """The dynamic-range plot as PNG bytes (None without matplotlib)."""
        return _range_plot(self.module_ranges(), self.dtype)

    def save_plot(self, path: str | Path) -> Path:
        """Write the dynamic-range plot to ``path`` as PNG (needs matplotlib)."""
        png = self.plot_png()
        if png is None:
            raise ImportError("The plot needs matplotlib: pip install 'amped[cli]'")
        path = Path(path)
        path.write_bytes(png)
        return path

    def save_html(self, path: str | Path) -> Path:
        """Write a self-contained HTML page (summary, plot, culprits, tables) to ``path``."""
        path = Path(path)
        path.write_text(self.to_html(), encoding="utf-8")
        return path

    def to_html(self) -> str:
        """The self-contained HTML page that :meth:`save_html` writes."""
        png = self.plot_png()
        plot = (
            f'<img alt="dynamic range per module" src="data:image/png;base64,'
            f'{base64.b64encode(png).decode()}">'
            if png is not None
            else "<p>(install matplotlib, e.g. <code>pip install amped[cli]</code>, for a plot)</p>"
        )
        rows = "".join(
            f"<tr><td>{o.index}</td><td>{html.escape(o.module or '<root>')}</td>"
            f"<td>{html.escape(o.op)}</td><td>{o.dtype}</td><td>{o.amax:.3g}</td>"
            f"<td>{o.n_inf}</td><td>{o.n_nan}</td><td>{_fmt(o.underflow, '.2%')}</td>"
            f"<td>{_fmt(o.sqnr_db, '.1f')}</td></tr>"
            for o in self.ops
        )
        return _PAGE.format(
            title=f"amped doctor: {self.dtype} on {self.device_type}",
            summary=html.escape(self.summary()),
            plot=plot,
            rows=rows,
        )


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None or math.isnan(value) else format(value, spec)


def _finite_json(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _finite_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_json(v) for v in value]
    return value


def _range_plot(ranges: dict[str, tuple[float, float, bool]], dtype: str) -> bytes | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    lim = limits(getattr(torch, dtype))
    names = [n for n, (_, hi, bad) in ranges.items() if hi > 0 or bad]
    fig, ax = plt.subplots(figsize=(9, 0.4 * len(names) + 2.2))
    lows = [math.log2(lim.min_subnormal)]
    highs = [math.log2(lim.max)]
    for i, name in enumerate(names):
        lo, hi, bad = ranges[name]
        hi = hi if hi > 0 else lim.max
        lo = lo if math.isfinite(lo) else hi
        x0, x1 = math.log2(lo), math.log2(hi)
        lows.append(x0)
        highs.append(x1)
        color = "tab:red" if bad or hi > lim.max else "tab:blue"
        ax.plot([x0, x1], [i, i], lw=7, color=color, solid_capstyle="butt")
        if bad:
            ax.annotate(
                "inf/NaN",
                (math.log2(lim.max), i),
                xytext=(4, -3),
                textcoords="offset points",
                color="tab:red",
                fontsize=8,
            )
    for value, label in (
        (lim.max, "max"),
        (lim.min_normal, "min normal"),
        (lim.min_subnormal, "min subnormal"),
    ):
        ax.axvline(math.log2(value), color="gray", lw=1, ls="--")
        ax.annotate(
            f"{lim.name} {label}",
            (math.log2(value), 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(2, 2),
            textcoords="offset points",
            fontsize=8,
            rotation=0,
        )
    ax.axvspan(math.log2(lim.max), max(highs) + 4, color="tab:red", alpha=0.08)
    ax.axvspan(min(lows) - 4, math.log2(lim.min_subnormal), color="tab:orange", alpha=0.08)
    ax.set_xlim(min(lows) - 4, max(highs) + 4)
    ax.set_ylim(-0.7, len(names) - 0.3)
    # Module names are the user's: "$" in one must not start matplotlib's mathtext.
    ax.set_yticks(range(len(names)), names, fontsize=8, parse_math=False)
    ax.set_xlabel("log2 |value| produced by the module's ops (red: overflow, inf or NaN)")
    ax.set_title(f"Dynamic range per module in the {dtype} run", pad=18)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>body{{font-family:sans-serif;margin:2em auto;max-width:1100px;padding:0 1em}}
pre{{background:#f4f4f4;padding:1em;white-space:pre-wrap;overflow-wrap:anywhere}}
img{{max-width:100%}}
table{{border-collapse:collapse;font-size:12px}}
td,th{{border:1px solid #ccc;padding:2px 6px}}</style>
</head><body><h1>{title}</h1><pre>{summary}</pre>{plot}
<h2>Ops</h2><table><tr><th>#</th><th>module</th><th>op</th><th>dtype</th><th>max |x|</th>
<th>inf</th><th>NaN</th><th>underflow</th><th>SQNR dB</th></tr>{rows}</table></body></html>
"""
