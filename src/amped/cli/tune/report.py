"""``amped tune``'s report folder: ``tuned.json`` and one self-contained ``tune.html``.

``tuned.json`` is the tuner's document exactly (``amped.tuning.TuneResult.to_dict()``),
which ``amped.prepare(model, optimizer, "DIR/tuned.json")`` loads. ``tune.html`` shows
it as compare's ``report.html`` shows a comparison (the same style, everything inline):
the outcome, the per-layer chart and table, the verification with per-seed losses and
spread (a failed verification in red, said to have failed), and what ran. The two are
written as one set by :func:`amped._internal.files.write_files`.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

from amped._internal.files import write_files
from amped.cli.compare.report import REPORT_CSS
from amped.cli.tune.plots import format_colours, sensitivity_chart
from amped.comparison.results import dumps
from amped.tuning import summary as tune_summary

__all__ = ["render_html", "write_report"]

_CSS = """
.outcome { padding: .6rem 1rem; border-radius: 6px; border: 1px solid; }
.outcome.passed { background: #e9f6ec; border-color: #8cc79a; }
.outcome.failed, .outcome.no_plan, .outcome.incomplete { background: #fdecec;
  border-color: #e09a9a; }
td.choice span { display: inline-block; padding: 0 .45rem; border-radius: 4px; }
tr.plan td { font-weight: 600; }
td.layer { white-space: normal; overflow-wrap: anywhere; text-align: left; }
td.fmt { line-height: 1.3; }
th { white-space: normal; }
"""


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _html_table(rows: list[dict[str, str]], css: list[str], cells: Any = None) -> str:
    head = "".join(f"<th>{_e(key)}</th>" for key in rows[0])
    body = []
    for row, row_css in zip(rows, css, strict=True):
        tds = "".join((cells or _cell)(key, value) for key, value in row.items())
        body.append(f'<tr class="{row_css}">{tds}</tr>')
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _cell(key: str, value: str) -> str:
    return f'<td class="{_e(key.replace(" ", "-"))}">{_e(value)}</td>'


def _layers(tuned: dict[str, Any]) -> str:
    rows = tune_summary.layer_rows(tuned)
    if not rows:
        return "<p class='foot'>No layer was measured.</p>"
    colours = format_colours(tuned)

    formats = set(tune_summary.candidate_formats(tuned))

    def cells(key: str, value: str) -> str:
        if key in formats:  # "29 dB / 9.3e-05" on two lines: six formats fit the page
            sqnr, _, estimate = value.partition(" / ")
            return f'<td class="fmt">{_e(sqnr)}<br>{_e(estimate)}</td>'
        if key != "choice":
            return _cell(key, value)
        colour = colours.get(value, colours["bf16"])
        text = "#000" if value == "bf16" else "#fff"
        span = f'<span style="background:{colour};color:{text}">{_e(value)}</span>'
        return f'<td class="choice">{span}</td>'

    return _html_table(rows, ["" for _ in rows], cells)


def _verification(tuned: dict[str, Any]) -> str:
    rows = tune_summary.verification_rows(tuned)
    css = []
    for row in rows:
        plan = row["arm"] == "plan"
        css.append(("plan failed" if row["verdict"] != "passed" else "plan") if plan else "")
    verification = tuned["verification"]
    intro = (
        f"<p class='sub'>Final train loss (the mean over the last tenth of the steps) after "
        f"{verification['steps']} steps per run, paired: for a seed, every arm starts from "
        "the same weights and sees the same batches. std: over the seeds; gap: the mean "
        "minus bf16-mixed's mean, which must stay within the budget "
        f"{tune_summary.format_estimate(tuned['budget']['value'])}. The "
        f"{_e(tune_summary.rule_text(tuned))}.</p>"
    )
    return intro + _html_table(rows, css)


def _rounds(tuned: dict[str, Any]) -> str:
    rows = tune_summary.round_rows(tuned)
    if not rows:
        return ""
    css = ["" if row["verdict"] == "passed" else "plan failed" for row in rows]
    intro = (
        "<p class='sub'>Each round trains one plan along the estimate's order of plans "
        "(each the most GEMM FLOPs for its estimated loss change): the first is the last "
        "within the budget by the estimate; after a pass the next is halfway to the "
        "largest plan not yet failed, after a failure halfway back to the largest passed. "
        "Then the first/last-N rules are candidates too, in the estimate's order: a rule "
        "is trained only when it could beat the best plan so far (as many GEMM FLOPs or "
        "more) and contains no plan that failed. The plan kept is the one that passed "
        "with the most GEMM FLOPs (speed-weighted), ties to the smaller gap, whichever "
        f"source it came from: here {_e(tuned.get('source', 'estimate'))}.</p>"
    )
    return "<h3>Rounds</h3>" + intro + _html_table(rows, css)


def _attention(tuned: dict[str, Any]) -> str:
    rows = tune_summary.attention_rows(tuned)
    if not rows:
        return ""
    intro = (
        f"<p class='sub'>Each role of {_e(tuned['attention_tuning']['config'])} cast alone "
        "on the model's attention calls: sqnr, the worst of out, dQ, dK and dV over the "
        "attention modules, against float32; estimate, the loss change of the output's "
        "error (0 for a backward role). The roles are lowered in this order, on top of the "
        "layers' plan, as far as the budget and the verification allow. "
        f"{_e(tune_summary.attention_text(tuned))}</p>"
    )
    css = ["" if row["choice"] == "bf16" else "plan" for row in rows]
    return "<h2>Attention roles</h2>" + intro + _html_table(rows, css)


def _chart(tuned: dict[str, Any]) -> str:
    png = sensitivity_chart(tuned)
    if png is None:
        return ""
    data = base64.b64encode(png).decode("ascii")
    caption = "Sensitivity per layer, in model order, and the format chosen"
    return (
        f'<figure id="plot-sensitivity"><img alt="{_e(caption)}" '
        f'src="data:image/png;base64,{data}"><figcaption>{_e(caption)}</figcaption></figure>'
    )


def _text(value: Any) -> str:
    """A value as a reader wants it: dicts and lists flattened, numbers short."""
    if isinstance(value, dict):
        return ", ".join(f"{k} {_text(v)}" for k, v in value.items()) or "none"
    if isinstance(value, (list, tuple)):
        return ", ".join(_text(v) for v in value) or "none"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _facts(tuned: dict[str, Any], context: dict[str, Any]) -> str:
    settings = tuned["settings"]
    skipped = settings.get("skipped_layers") or {}
    runs = f"{settings['steps']} steps x {settings['seeds']} seeds from seed {settings['seed']}"
    rows = [
        ("task", context.get("task", "")),
        ("device", context.get("device", "")),
        ("base recipe", tuned["base"]),
        ("candidate formats", ", ".join(tune_summary.candidate_formats(tuned))),
        ("format speeds for", f"{settings['target']}: {_text(settings.get('speedups', {}))}"),
        ("budget", f"{tuned['budget']['value']:.3g} ({tuned['budget']['source']})"),
        ("verification", f"{runs}, per arm"),
        ("layers not tuned", "; ".join(f"{n}: {why}" for n, why in skipped.items()) or "none"),
        ("measurement passes", _text(tuned.get("passes") or {})),
        ("seconds", _text(settings.get("seconds", ""))),
        ("created", context.get("created", "")),
        ("command", " ".join(context.get("command", []))),
    ]
    items = "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in rows if v != "")
    return f'<dl class="env">{items}</dl>'


def render_html(tuned: dict[str, Any], context: dict[str, Any]) -> str:
    """The whole report page for ``tuned``; ``context`` says what ran (``task``,
    ``device``, ``created``, ``command``), as the report's subtitle and facts."""
    state = tune_summary.outcome(tuned)
    name = context.get("task", "the model")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>amped tune: {_e(name)}</title><style>{REPORT_CSS}{_CSS}</style></head>
<body>
<h1>Which layers of {_e(name)} can run in low precision</h1>
<p class="sub">{_e(context.get("device", ""))} · {_e(context.get("created", ""))}</p>
<p class="outcome {state}">{_e(tune_summary.headline(tuned))}</p>
<h2>Per layer</h2>
{_chart(tuned)}
<p class="sub">Each cell: output SQNR in dB against the bf16 layer / the estimated loss
change of that layer alone in that format.</p>
{_layers(tuned)}
{_attention(tuned)}
<h2>Verification</h2>
{_verification(tuned)}
{_rounds(tuned)}
<h2>What ran</h2>
{_facts(tuned, context)}
<p class="foot">Every number is in <code>tuned.json</code> beside this file (schema
<code>{_e(tuned["schema"])}</code>); <code>amped.prepare(model, optimizer,
"tuned.json")</code> applies the plan.</p>
</body></html>
"""


def write_report(tuned: dict[str, Any], context: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """Render both files, then write ``tuned.json`` and ``tune.html`` into ``out`` as one
    set (raises OSError, leaving the previous pair, if they cannot be written)."""
    json_path, html_path = out / "tuned.json", out / "tune.html"
    write_files([(json_path, dumps(tuned)), (html_path, render_html(tuned, context))])
    return json_path, html_path
