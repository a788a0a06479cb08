"""A :class:`~amped.verification.report.VerifyReport` as a page: ``verify.html``.

One self-contained page (no script, no external asset): the verdict, the flags, and a
table of every GEMM with what ran and how it compares, as ``doctor.html`` shows a
diagnosis. ``report`` is typed ``Any``, as in :mod:`amped.cli.doctor.html`.
"""

from __future__ import annotations

import html
from typing import Any

__all__ = ["verify_html"]

_STYLE = (
    "body{font-family:system-ui,sans-serif;margin:2em;max-width:70em}"
    "table{border-collapse:collapse}td,th{padding:.2em .6em;text-align:left;"
    "border-bottom:1px solid #ddd}td.n{text-align:right}tr.bad{background:#fee}"
    ".ok{color:#070}.flag{color:#b00}"
)


def _row(gemm: Any, flagged: bool) -> str:
    casts = "<br>".join(
        html.escape(
            f"{c.operand}: {c.ran}" + ("" if c.ran == c.expected else f" (recipe: {c.expected})")
        )
        for c in gemm.casts
    )
    bitwise = "yes" if all(c.mismatched == 0 for c in gemm.casts) else "no"
    cells = [
        html.escape(gemm.layer),
        gemm.role,
        html.escape(gemm.ran),
        casts,
        bitwise,
        f"{gemm.max_ratio:.3g}",
        str(gemm.outside),
    ]
    tds = "".join(
        f'<td class="n">{c}</td>' if i >= 5 else f"<td>{c}</td>" for i, c in enumerate(cells)
    )
    return f"<tr{' class=bad' if flagged else ''}>{tds}</tr>"


def verify_html(report: Any) -> str:
    """The page of ``report``."""
    title = f"amped verify: {report.backend} against {report.recipe}"
    flagged = {(f.layer, f.role) for f in report.flags}
    if report.ok:
        verdict = (
            f'<p class="ok">No flags: every cast of {len(report.layers)} layers is the '
            "reference's bit for bit, every GEMM output within its bound.</p>"
        )
    else:
        items = "".join(f"<li>{html.escape(str(flag))}</li>" for flag in report.flags)
        verdict = f'<p class="flag">{len(report.flags)} flags:</p><ul>{items}</ul>'
    head = (
        "<tr><th>layer</th><th>role</th><th>ran</th><th>casts</th><th>bitwise</th>"
        "<th>error / bound</th><th>outside</th></tr>"
    )
    rows = "".join(_row(g, (g.layer, g.role) in flagged) for g in report.gemms)
    return (
        f"<!doctype html><html><head><meta charset=utf-8><title>{html.escape(title)}</title>"
        f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>{verdict}"
        f"<table>{head}{rows}</table><p>error / bound: the largest ratio of an output "
        "element's distance from the exact product of its operands to its bound (float32 "
        "accumulation, docs/verify.md); at most 1 within it.</p></body></html>\n"
    )
