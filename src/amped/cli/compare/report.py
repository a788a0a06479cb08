"""The report folder: ``results.json`` and one self-contained ``report.html``.

The HTML file carries everything inline (CSS, and the plots as base64 PNG ``data:``
URIs), so it can be mailed or attached to a ticket as one file; it loads nothing and
runs no script. The two are written as one set by :func:`amped._internal.files.write_files`:
atomically, never through a symlink, and never a new file beside an old partner.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

from amped._internal.files import write_files
from amped.cli import plots
from amped.comparison import summary
from amped.comparison.findings import warnings
from amped.comparison.results import dumps

__all__ = ["REPORT_CSS", "render_html", "write_report"]

# The style of every report page (the tune report uses it too).
REPORT_CSS = """
body { font: 15px/1.5 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1d1d1f;
       max-width: 1100px; margin: 2rem auto; padding: 0 1.2rem; background: #fff; }
h1 { font-size: 1.6rem; margin-bottom: .2rem; } h2 { margin-top: 2.2rem; font-size: 1.2rem; }
h3 { font-size: 1rem; margin: 1.2rem 0 .3rem; }
.sub { color: #666; margin-top: 0; }
.banner { background: #fff3cd; border: 1px solid #e0c36c; padding: .6rem 1rem; border-radius: 6px; }
ul.findings li { margin: .25rem 0; }
table { border-collapse: collapse; font-size: 13px; width: 100%; }
th, td { padding: .35rem .55rem; border-bottom: 1px solid #e3e3e3; text-align: right;
         white-space: nowrap; }
th:first-child, td:first-child, td.flags, th.flags { text-align: left; }
th { background: #f5f5f7; font-weight: 600; }
tr.slow td { background: #fbf6ea; } tr.failed td { background: #fdecec; }
.foot { color: #555; font-size: 12.5px; } .foot li { margin: .1rem 0; }
figure { margin: 1.2rem 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #666; font-size: 13px; }
dl.env { display: grid; grid-template-columns: max-content 1fr; gap: .2rem 1.2rem;
         font-size: 13.5px; }
dl.env dt { color: #666; } dl.env dd { margin: 0; font-family: ui-monospace, monospace;
         overflow-wrap: anywhere; }
code { font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 13px; }
"""


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _table(results: dict[str, Any]) -> str:
    """The comparison as the console shows it: one table per :data:`summary.GROUPS` entry."""
    headers = dict(zip((k for k, _ in summary.COLUMNS), summary.headers(results), strict=True))
    rows = summary.rows(results)
    parts = []
    for group, keys in summary.GROUPS:
        head = "".join(f'<th class="{key}">{_e(headers[key])}</th>' for key in keys)
        body = []
        for recipe, row in zip(results["recipes"], rows, strict=True):
            css = "failed" if recipe["status"] == "failed" or recipe.get("diverged") else ""
            css = css or ("slow" if recipe["slow_on_this_hardware"] else "")
            cells = "".join(f'<td class="{k}">{_e(row[k])}</td>' for k in keys)
            body.append(f'<tr class="{css}" title="{_e(recipe["summary"])}">{cells}</tr>')
        parts.append(
            f"<h3>{_e(group)}</h3><table><thead><tr>{head}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table>"
        )
    return "\n".join(parts)


def _figures(results: dict[str, Any]) -> str:
    images = plots.render_all(results)
    parts = []
    for key, title, _ in plots.PLOTS:
        png = images[key]
        if png is None:
            parts.append(f"<p class='foot'>{_e(title)}: nothing to plot in this comparison.</p>")
            continue
        data = base64.b64encode(png).decode("ascii")
        parts.append(
            f'<figure id="plot-{key}"><img alt="{_e(title)}" '
            f'src="data:image/png;base64,{data}"><figcaption>{_e(title)}</figcaption></figure>'
        )
    return "\n".join(parts)


_LABELS: dict[str, str] = {
    "cpu_count": "cpu cores",
    "torch_threads": "torch threads",
    "cpu_capability": "cpu capability (torch)",
    "max_time_s": "max time (s)",
    "threads_source": "threads chosen by",
}
_MACHINE: dict[str, str] = {
    "cores": "cores available",
    "other_processes_cores": "other processes' CPU use while timing (cores)",
    "load_average_1min": "load average (1 min) at the end",
    "busy": "busy machine",
}


def _text(key: str, value: Any) -> str:
    """A value as a reader wants it: lists joined, no ``None`` (what it means instead)."""
    if value is None:
        return {"batch_size": "the factory's default", "max_time_s": "no limit"}.get(key, "unknown")
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value) if value else "none"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_text(k, v)}" for k, v in value.items())
    return str(value)


def _environment(results: dict[str, Any]) -> str:
    env = dict(results["environment"])
    gpu = env.pop("gpu", None)
    native = env.pop("native_low_precision", None) or {}
    gemm = env.pop("emulated_gemm", None)
    rows: list[tuple[str, str]] = [
        (_LABELS.get(str(k), str(k)), _text(k, v)) for k, v in env.items()
    ]
    if gpu:
        rows += [(f"gpu {k}", _text(k, v)) for k, v in gpu.items()]
    rows += [
        (f"native {k} matmul", {True: "yes", False: "no", None: "unknown"}[v])
        for k, v in native.items()
    ]
    if gemm:
        chosen = f"{gemm['dtype']} ({gemm['chosen_by']}: {gemm['reason']})"
        rows.append(("emulated FP8/block GEMMs in", chosen))
    machine = results.get("machine") or {}
    rows += [(_MACHINE[k], _text(k, v)) for k, v in machine.items() if k in _MACHINE]
    rows += [(_LABELS.get(k, k.replace("_", " ")), _text(k, v))
             for k, v in results["config"].items() if k != "device"]  # fmt: skip
    rows.append(("command", " ".join(results["command"])))
    items = "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in rows)
    return f'<dl class="env">{items}</dl>'


def render_html(results: dict[str, Any]) -> str:
    """The whole report page for ``results``."""
    task = results["task"] or {}
    name = task.get("name", results["config"]["task"])
    banner = ""
    if results["partial"]:
        banner = (
            '<p class="banner"><strong>Partial results.</strong> The comparison was '
            "interrupted; recipes that did not finish are marked.</p>"
        )
    banner += "".join(
        f'<p class="banner"><strong>Warning.</strong> {_e(line)}</p>' for line in warnings(results)
    )
    shown = set(warnings(results))
    findings = "".join(
        f"<li>{_e(line)}</li>" for line in summary.findings(results) if line not in shown
    )
    subtitle = (task.get("description"), results["config"]["device"],
                *summary.run_facts(results), results["created"],
                f"{results['wall_s']:.0f} s")  # fmt: skip
    notes = "".join(f"<li>{_e(line)}</li>" for line in summary.footnotes(results))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>amped compare: {_e(name)}</title><style>{REPORT_CSS}</style></head>
<body>
<h1>What mixed precision buys {_e(name)}</h1>
<p class="sub">{" · ".join(_e(part) for part in subtitle if part)}</p>
{banner}
<ul class="findings">{findings}</ul>
<h2>Comparison</h2>
{_table(results)}
<ul class="foot">{notes}</ul>
<h2>Plots</h2>
{_figures(results)}
<h2>Environment</h2>
{_environment(results)}
<p class="foot">Every number is in <code>results.json</code> beside this file
(schema <code>{_e(results["schema"])}</code>).</p>
</body></html>
"""


def write_report(results: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """Render both files, then write ``results.json`` and ``report.html`` into ``out``
    as one set (raises OSError, leaving the previous pair, if they cannot be written)."""
    json_path, html_path = out / "results.json", out / "report.html"
    write_files([(json_path, dumps(results)), (html_path, render_html(results))])
    return json_path, html_path
