"""``amped tune``'s table, report and chart, rendered from hand-written tuned.json
documents (tests/helpers/tune_fixture.py) for each outcome: passed, failed, incomplete, no plan.

The command itself, on the real tuner, is tested in test_cli_tune.py.
"""

from __future__ import annotations

import io
import re

import pytest

pytest.importorskip("rich")
pytest.importorskip("matplotlib")

import tune_fixture
from cli_fault_helpers import unwrap
from rich.console import Console

from amped._internal.jsonio import from_json
from amped.cli.tune.command import exit_code
from amped.cli.tune.plots import sensitivity_chart
from amped.cli.tune.report import render_html, write_report
from amped.cli.tune.table import layer_tables, print_tune
from amped.tuning.summary import (
    attention_rows,
    headline,
    layer_rows,
    outcome,
    round_rows,
    verification_rows,
)

CONTEXT = {"task": "tiny-gpt", "device": "cpu", "created": "2026-12-01T18:00:00+00:00",
           "command": ["amped", "tune", "--formats", "fp8-rowwise,nvfp4"]}  # fmt: skip
OUTCOMES = {
    "passed": tune_fixture.passed,
    "failed": tune_fixture.failed,
    "incomplete": tune_fixture.incomplete,
    "no_plan": tune_fixture.no_plan,
}


def _printed(tuned: dict, width: int = 160) -> str:
    buffer = io.StringIO()
    print_tune(tuned, (), Console(file=buffer, width=width, color_system=None))
    return buffer.getvalue()


@pytest.mark.parametrize("name", list(OUTCOMES))
def test_outcome_of_each_document(name):
    assert outcome(OUTCOMES[name]()) == name


@pytest.mark.parametrize(
    ("name", "code", "said"),
    [
        ("passed", 0, ""),
        ("failed", 3, "amped tune: the plan failed its verification"),
        ("incomplete", 3, "amped tune: --max-time ran out before the verification finished"),
        ("no_plan", 3, "amped tune: no plan met the budget"),
    ],
    ids=list(OUTCOMES),
)
def test_the_exit_code_of_each_outcome(capsys, name, code, said):
    assert exit_code(OUTCOMES[name]()) == code
    err = " ".join(unwrap(capsys.readouterr().err))
    assert err.startswith(said) and (not said or err.rstrip().endswith("exit status 3"))


def test_layer_rows_are_in_model_order_with_a_cell_per_format_and_the_choice():
    rows = layer_rows(tune_fixture.passed())
    assert [r["layer"] for r in rows] == list(tune_fixture.LAYERS)
    assert [r["choice"] for r in rows] == list(tune_fixture.PLAN.values())
    assert rows[0]["fp8-rowwise"] == "31 dB / 2.1e-04"
    assert rows[0]["nvfp4"] == "18 dB / 3.3e-03"
    assert rows[-1]["fp8-rowwise"].startswith("inf dB")  # an exact output
    assert rows[0]["flops"] == "37.7M"  # 6 * 64 * 192 * 512 = 37,748,736


def test_a_format_a_layer_cannot_run_is_a_dash():
    tuned = tune_fixture.passed()
    del tuned["measurements"]["head"]["formats"]["nvfp4"]
    assert layer_rows(tuned)[-1]["nvfp4"] == "—"


def test_verification_rows_give_per_seed_losses_std_gap_and_verdicts():
    rows = {r["arm"]: r for r in verification_rows(tune_fixture.failed())}
    assert [rows["plan"][f"seed {s}"] for s in (0, 1, 2)] == ["2.4610", "2.4580", "2.4700"]
    assert rows["plan"]["verdict"] == "FAILED"
    assert rows["plan"]["gap"] == "+0.0503"  # mean 2.4630 - bf16-mixed's 2.41267
    assert rows["bf16-mixed"]["gap"] == "+0.0000" and rows["bf16-mixed"]["verdict"] == ""
    assert rows["rule"]["verdict"] == "over"
    assert rows["plan"]["lowered"] == "4/5 (75%)"


def test_runs_cut_by_max_time_are_dashes_and_incomplete():
    rows = {r["arm"]: r for r in verification_rows(tune_fixture.incomplete())}
    assert [rows["plan"][f"seed {s}"] for s in (0, 1, 2)] == ["2.4180", "—", "—"]
    assert rows["plan"]["verdict"] == "incomplete"
    assert rows["rule"]["mean"] == "—" and rows["rule"]["gap"] == "—"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("passed", "Verification passed"),
        ("failed", "Verification FAILED"),
        ("incomplete", "the plan does not pass"),
        ("no_plan", "No plan meets the budget: the smallest estimated loss change"),
    ],
    ids=list(OUTCOMES),
)
def test_headline_says_the_outcome(name, expected):
    assert expected in headline(OUTCOMES[name]())


def test_the_terminal_shows_both_tables_and_the_outcome():
    text = _printed(tune_fixture.failed())
    for name in tune_fixture.LAYERS:
        assert name in text
    assert "FAILED" in text and "Verification FAILED" in text
    assert text.index("blocks.0.attn.qkv") < text.index("head ")  # model order


def test_the_rounds_are_shown_in_order_with_the_plan_kept_marked():
    tuned = tune_fixture.passed()
    rows = round_rows(tuned)
    assert [(r["round"], r["verdict"], r["chosen"]) for r in rows] == [
        ("1", "passed", "<- plan"),
        ("2", "FAILED", ""),
    ]
    assert rows[1]["lowered"] == "5/5 (100%)" and rows[1]["gap"] == "+0.0213"
    assert rows[0]["formats"] == "fp8-rowwise 2, nvfp4 2"  # which formats, not just how many
    text = _printed(tuned)
    assert "Rounds" in text and "<- plan" in text and "fp8-rowwise 2" in text
    page = render_html(tuned, {})
    assert "<h3>Rounds</h3>" in page and "+0.0213" in page
    assert "Rounds" not in _printed(tune_fixture.no_plan())


def test_a_rule_that_won_is_named_with_how_the_estimates_plan_verified():
    tuned = tune_fixture.rule_won()
    said = headline(tuned)
    assert "Verification passed" in said
    assert "The plan is a first/last-N rule (rule: first 1/last 1, fp8-rowwise)" in said
    assert "the estimate's own plan verified worse, 4/5 layers" in said
    assert "at a gap of +0.0503, over the budget" in said
    rows = round_rows(tuned)
    assert [(r["source"], r["verdict"], r["chosen"]) for r in rows] == [
        ("estimate", "FAILED", ""),
        ("rule: first 1/last 1, fp8-rowwise", "passed", "<- plan"),
    ]
    verification = {r["arm"]: r for r in verification_rows(tuned)}
    assert verification["estimate"]["verdict"] == "over"
    assert verification["plan"]["gap"] == verification["rule"]["gap"] == "+0.0027"
    text = _printed(tuned)
    assert "rule: first 1/last 1" in text and "+0.0497" in text
    page = render_html(tuned, {})
    assert "verified worse" in page and "here rule: first 1/last 1, fp8-rowwise" in page


def test_an_estimate_plan_says_so_and_no_rule_tried_renders():
    assert "The plan is the estimate's." in headline(tune_fixture.passed())
    tuned = tune_fixture.no_rule_tried()
    assert "rule" not in {r["arm"] for r in verification_rows(tuned)}
    text = _printed(tuned)
    assert "rule: none trained (no first/last-N rule could beat the plan)" in text
    assert "none trained" in render_html(tuned, {})


@pytest.mark.parametrize("width", [80, 100, 160])
def test_the_layer_tables_fit_the_width_keeping_every_format_and_the_end_of_names(width):
    tuned = tune_fixture.six_formats()
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, color_system=None)
    tables = layer_tables(tuned, width=width)
    for table in tables:
        console.print(table)
    lines = buffer.getvalue().splitlines()
    assert max(len(line.rstrip()) for line in lines) <= width
    headers = " ".join(lines)
    for fmt in tuned["settings"]["formats"]:  # every format's column, whole
        assert f" {fmt} " in headers
    assert buffer.getvalue().count("inf dB / 6.0e-04") == 6  # that layer's cells, uncut
    rows = [line for line in lines if "query_key_value" in line]
    assert len(rows) == len(tables)  # the layer in every table, its name's end kept
    assert len(tables) > 1


def test_the_tables_fit_80_columns_in_one_piece_for_two_formats():
    buffer = io.StringIO()
    print_tune(tune_fixture.failed(), (), Console(file=buffer, width=80, color_system=None))
    text = buffer.getvalue()
    assert "(1/2)" not in text and "…" not in text  # nothing cut or split
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 80


@pytest.mark.parametrize("name", list(OUTCOMES))
def test_the_page_has_the_chart_the_tables_and_the_outcome(name):
    tuned = OUTCOMES[name]()
    page = render_html(tuned, CONTEXT)
    assert page.count("data:image/png;base64,") == 1
    assert f'class="outcome {name}"' in page
    positions = [page.index(f">{layer}<") for layer in tune_fixture.LAYERS]
    assert positions == sorted(positions)  # model order
    assert "amped tune --formats fp8-rowwise,nvfp4" in page
    assert page.rstrip().endswith("</html>")


def test_a_failed_plan_is_marked_failed_on_the_page():
    page = render_html(tune_fixture.failed(), CONTEXT)
    assert re.search(r'<tr class="plan failed"><td class="arm">plan</td>', page)
    assert "Verification FAILED" in page
    passed = render_html(tune_fixture.passed(), CONTEXT)
    assert '<tr class="plan"><td class="arm">plan</td>' in passed
    assert "Verification FAILED" not in passed  # a larger plan's round did fail


def test_names_are_escaped():
    tuned = tune_fixture.passed()
    tuned["measurements"] = {"<b>x</b>": tuned["measurements"]["head"]}
    tuned["layers"] = {"<b>x</b>": "bf16"}
    page = render_html(tuned, {**CONTEXT, "task": "<script>"})
    assert "<b>x</b>" not in page and "&lt;b&gt;x&lt;/b&gt;" in page
    assert "<script>" not in page


def test_the_chart_takes_dollar_signs_in_module_names():
    tuned = tune_fixture.passed()
    tuned["measurements"] = {"a$^$b": tuned["measurements"]["head"]}
    tuned["layers"] = {"a$^$b": "fp8-rowwise"}
    assert sensitivity_chart(tuned)[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_chart_is_a_png_and_nothing_without_layers():
    tuned = tune_fixture.passed()
    assert sensitivity_chart(tuned)[:8] == b"\x89PNG\r\n\x1a\n"
    tuned["measurements"] = {}
    assert sensitivity_chart(tuned) is None


def test_the_pair_is_written_and_tuned_json_is_the_document(tmp_path):
    tuned = tune_fixture.no_plan()
    json_path, html_path = write_report(tuned, CONTEXT, tmp_path)
    assert (json_path.name, html_path.name) == ("tuned.json", "tune.html")
    assert from_json(json_path.read_text()) == tuned
    assert "No plan meets the budget" in html_path.read_text()


def test_the_attention_roles_are_shown_in_the_order_lowered_with_the_roles_kept():
    tuned = tune_fixture.with_attention()
    rows = attention_rows(tuned)
    assert [(r["role"], r["sqnr"], r["choice"]) for r in rows] == [
        ("o", "30 dB", "mxfp8/head"), ("dv", "29 dB", "mxfp8/head"), ("s", "1 dB", "bf16")
    ]  # fmt: skip
    assert "Attention: o, dv lowered (o:mxfp8/head,dv:mxfp8/head); s in bf16." in headline(tuned)
    assert [r["chosen"] for r in round_rows(tuned)] == ["", "", "<- plan"]
    assert round_rows(tuned)[2]["formats"] == "fp8-rowwise 2, nvfp4 2, attention 2"
    assert "Attention roles, in the order they are lowered" in _printed(tuned)
    page = render_html(tuned, CONTEXT)
    assert "<h2>Attention roles</h2>" in page and "s in bf16" in page


def test_a_document_without_attention_shows_no_attention_table():
    tuned = tune_fixture.passed()
    assert attention_rows(tuned) == []
    assert "Attention" not in _printed(tuned) and "Attention roles" not in render_html(tuned, {})
