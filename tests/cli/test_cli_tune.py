"""``amped tune`` end to end on the real tuner: the command in process and as the
installed script, the report pair it writes, its exit codes, and bad input as one line.

The renderer alone (every outcome, from hand-written documents) is tested in
test_cli_tune_report.py.
"""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("rich")
pytest.importorskip("matplotlib")

import tune_factories
from cli_fault_helpers import ENV, ROOT, one_line, unwrap

import amped
from amped._internal import files
from amped._internal.jsonio import from_json
from amped.cli import out_dir
from amped.cli.main import main
from amped.tuning.tuner import DEFAULT_FORMATS

TINY = ("--model", "tests/helpers/tune_factories.py:tiny", "--threads", "1", "--no-progress")
QUICK = (*TINY, "--formats", "fp8-rowwise,nvfp4", "--steps", "3", "--seeds", "2")
LAUNCH = [sys.executable, "-c", "import sys, amped_launch; sys.exit(amped_launch.main())"]


@pytest.fixture(autouse=True)
def _from_the_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # --model tests/helpers/tune_factories.py:... is relative to it


def _tune(capsys, out: Path, *args: str) -> tuple[int, str, str]:
    code = main(["tune", "--out", str(out), *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _usage_line(capsys, out: Path, *args: str) -> str:
    """exit 2, one ``amped: error:`` line, nothing on stdout, and no report folder."""
    code, stdout, err = _tune(capsys, out, *args)
    assert code == 2, err
    assert stdout == ""
    line = one_line(err)
    assert line.startswith("amped: error: "), line
    assert not out.exists()
    return line


# --- bad input: one line, exit 2, before anything runs ----------------------------------


@pytest.mark.parametrize(
    ("formats", "expected"),
    [
        ("fp9", "Unknown format 'fp9'"),
        ("fp8-rowwise,XYZ", "Unknown format 'xyz'"),
        ("bf16", "bf16 is always a choice: leave it out"),
        (",", "--formats names no format"),
        ("fp8-delayed", "Unknown format 'fp8-delayed'"),
    ],
    ids=["unknown", "one-of-two", "bf16", "empty", "delayed"],
)
def test_an_unknown_format_names_the_allowed_ones(capsys, tmp_path, formats, expected):
    line = _usage_line(capsys, tmp_path / "r", *TINY, "--formats", formats)
    assert expected in line
    assert ", ".join(DEFAULT_FORMATS) in line  # what is allowed
    assert f"Received: --formats {formats!r}" in line


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--budget", "-0.1", "argument --budget: expected a loss change >= 0"),
        ("--budget", "nan", "argument --budget: expected a loss change >= 0"),
        ("--budget", "inf", "argument --budget: expected a loss change >= 0"),
        ("--budget", "tiny", "argument --budget: expected a loss change >= 0"),
        ("--seeds", "0", "argument --seeds: expected a positive integer"),
        ("--steps", "-3", "argument --steps: expected a positive integer"),
        ("--max-time", "-1", "argument --max-time: expected seconds"),
        ("--seed", "-1", "argument --seed: expected an integer in [0, 2**64 - 1]"),
        ("--threads", "0", "argument --threads: expected a positive integer"),
        ("--rounds", "0", "argument --rounds: expected a positive integer"),
    ],
    ids=[
        "budget-negative",
        "budget-nan",
        "budget-inf",
        "budget-text",
        "seeds-0",
        "steps",
        "max-time",
        "seed",
        "threads",
        "rounds-0",
    ],
)
def test_a_bad_value_is_one_line(capsys, tmp_path, flag, value, expected):
    assert expected in _usage_line(capsys, tmp_path / "r", *TINY, flag, value)


def test_a_model_with_no_eligible_layer_is_one_line(capsys, tmp_path):
    spec = "tests/helpers/tune_factories.py:no_eligible_layer"
    line = _usage_line(capsys, tmp_path / "r", "--model", spec, "--threads", "1")
    assert f"The model from {spec} has no layer amped tune can lower" in line
    assert "0: its dims 10x6 are not multiples of 16" in line  # each layer, and why


def test_attention_for_a_model_without_attention_is_one_line(capsys, tmp_path):
    line = _usage_line(capsys, tmp_path / "r", *TINY, "--attention", "fp8")
    assert "--attention tunes the attention amped converts" in line
    assert "no nn.MultiheadAttention and not a transformers model" in line


def test_excluding_every_eligible_layer_is_one_line_naming_the_flags(capsys, tmp_path):
    line = _usage_line(capsys, tmp_path / "r", *TINY, "--module-filter", "[02]",
                       "--exclude", "0,2")  # fmt: skip
    assert "has no layer amped tune can lower" in line
    assert "4: not chosen by --module-filter '[02]' --exclude '0,2'" in line


def test_module_filter_and_exclude_choose_the_layers_tuned(capsys, tmp_path):
    code, _, err = _tune(capsys, tmp_path, *QUICK, "--budget", "1.0", "--rounds", "1",
                         "--module-filter", "0,2", "--exclude", "2")  # fmt: skip
    assert code == 0, err
    assert list(_document(tmp_path)["layers"]) == ["0"]  # the only layer measured


@pytest.mark.parametrize("out", ["", "x" * 300], ids=["empty", "name-300"])
def test_a_bad_out_is_one_line(capsys, tmp_path, monkeypatch, out):
    line = _usage_line(capsys, tmp_path / "unused", *TINY, "--out", out)
    assert "argument --out:" in line


def test_an_out_that_is_a_file_is_one_line(capsys, tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    code, _, err = _tune(capsys, target, *TINY)
    assert code == 2 and "--out must be a folder" in one_line(err)


def _holder(out: str, claimed, done) -> None:
    out_dir.resolve_out(out)
    claimed.set()
    done.wait(60)
    os._exit(0)


def test_a_busy_out_is_refused_naming_the_holder(capsys, tmp_path):
    context = multiprocessing.get_context("fork")
    claimed, done = context.Event(), context.Event()
    holder = context.Process(target=_holder, args=(str(tmp_path), claimed, done))
    holder.start()
    try:
        assert claimed.wait(60)
        code, _, err = _tune(capsys, tmp_path, *TINY)
        assert code == 2
        assert f"Another amped run (pid {holder.pid})" in one_line(err)
    finally:
        done.set()
        holder.join(60)


# --- runs -------------------------------------------------------------------------------


def _document(out: Path) -> dict:
    return from_json((out / "tuned.json").read_text())


def test_a_plan_within_a_given_budget_passes_and_prepare_loads_it(capsys, tmp_path):
    code, stdout, err = _tune(capsys, tmp_path / "r", *QUICK, "--budget", "1.0")
    assert code == 0, err
    tuned = _document(tmp_path / "r")
    assert tuned["schema"] == "amped.tune/1" and tuned["passed"] is True
    assert list(tuned["layers"]) == ["0", "2", "4"]  # the three Linears, model order
    assert set(tuned["layers"].values()) <= {"bf16", "fp8-rowwise", "nvfp4"}
    assert tuned["budget"]["value"] == 1.0 and tuned["budget"]["source"] == "given"
    # The table names every layer and the verdict; the page holds the chart.
    assert "Verification passed" in " ".join(stdout.split())
    page = (tmp_path / "r" / "tune.html").read_text()
    assert page.count("data:image/png;base64,") == 1 and 'class="outcome passed"' in page
    # prepare converts exactly the layers the plan lowered, each to its format's layer.
    model, _, _ = tune_factories.tiny()
    amped.prepare(model, torch.optim.AdamW(model.parameters()), str(tmp_path / "r/tuned.json"))
    modules = dict(model.named_modules())
    kinds = {"bf16": "Linear", "fp8-rowwise": "Float8Linear", "nvfp4": "BlockLinear"}
    assert {n: type(modules[n]).__name__ for n in tuned["layers"]} == {
        n: kinds[f] for n, f in tuned["layers"].items()
    }


def test_each_format_warms_up_before_the_clock_and_says_so(capsys, tmp_path):
    code, _, err = _tune(capsys, tmp_path, *QUICK, "--budget", "1.0", "--rounds", "1")
    assert code == 0, err
    lines = unwrap(err)
    warm = [i for i, line in enumerate(lines) if line.startswith("amped tune: warm-up of ")]
    assert [lines[i].split(" (")[0] for i in warm] == [
        "amped tune: warm-up of fp8-rowwise",
        "amped tune: warm-up of nvfp4",
    ]
    assert "outside --max-time" in lines[warm[0]]
    assert warm[-1] < next(i for i, line in enumerate(lines) if "measuring" in line)


def test_json_prints_the_document_written(capsys, tmp_path):
    code, stdout, err = _tune(capsys, tmp_path, *QUICK, "--budget", "1.0", "--json")
    assert code == 0, err
    assert json.loads(stdout) == json.loads((tmp_path / "tuned.json").read_text())


def test_rounds_caps_the_plans_verified(capsys, tmp_path):
    # tuned.json's settings record the rounds amped.tune ran with (default 4).
    code, _, err = _tune(capsys, tmp_path, *QUICK, "--budget", "1.0", "--rounds", "1")
    assert code == 0, err
    tuned = _document(tmp_path)
    assert tuned["settings"]["rounds"] == 1
    sources = [r["source"] for r in tuned["rounds"]]
    assert sources[0] == "estimate" and len(sources) <= 2  # one plan, at most one rule
    assert all(s.startswith("rule: ") for s in sources[1:])


@pytest.mark.slow
def test_a_rule_that_beats_the_estimates_plan_is_the_plan_and_is_said(capsys, tmp_path):
    # MXFP4 on the tiny MLP, one round: the estimate's plan lowers layer "0" and passes
    # (gap about -7e-4); the rule "first 1/last 1" lowers layer "2", as many FLOPs, and
    # trains to about -3e-3: the same saving at a smaller gap, so the rule is the plan.
    code, stdout, err = _tune(capsys, tmp_path, *TINY, "--formats", "mxfp4", "--steps", "4",
                              "--seeds", "2", "--rounds", "1", "--budget", "3e-4")  # fmt: skip
    assert code == 0, err
    tuned = _document(tmp_path)
    assert tuned["source"] == "rule: first 1/last 1, mxfp4"
    assert tuned["layers"] == {"0": "bf16", "2": "mxfp4", "4": "bf16"}
    arms = tuned["verification"]["arms"]
    assert arms["estimate"]["layers"] == {"0": "mxfp4", "2": "bf16", "4": "bf16"}
    assert arms["plan"]["gap"] < arms["estimate"]["gap"]
    assert [r["source"] for r in tuned["rounds"]] == ["estimate", tuned["source"]]
    text = " ".join(stdout.split())
    assert "The plan is a first/last-N rule (rule: first 1/last 1, mxfp4)" in text
    assert "the estimate's own plan verified worse, 1/3 layers" in text
    page = (tmp_path / "tune.html").read_text()
    assert "verified worse" in page


def test_a_budget_no_plan_meets_writes_the_all_bf16_plan_and_exits_3(capsys, tmp_path):
    code, stdout, err = _tune(capsys, tmp_path, *QUICK, "--budget", "0")
    assert code == 3, err
    tuned = _document(tmp_path)
    assert set(tuned["layers"].values()) == {"bf16"}
    assert tuned["reason"].startswith("no plan meets the budget")
    assert "amped tune: no plan met the budget" in err and "exit status 3" in err
    assert "No plan meets the budget" in " ".join(stdout.split())
    assert 'class="outcome no_plan"' in (tmp_path / "tune.html").read_text()


def test_a_verification_cut_by_max_time_does_not_pass(capsys, tmp_path):
    code, _, err = _tune(capsys, tmp_path, *QUICK, "--budget", "1.0", "--max-time", "1e-6")
    assert code == 3, err
    tuned = _document(tmp_path)
    assert tuned["passed"] is False
    assert not tuned["verification"]["arms"]["plan"]["completed"]
    assert "--max-time ran out before the verification finished" in err
    assert 'class="outcome incomplete"' in (tmp_path / "tune.html").read_text()


def test_a_write_error_is_exit_1_and_keeps_the_old_pair(capsys, tmp_path, monkeypatch):
    (tmp_path / "tuned.json").write_text('{"old": true}')
    (tmp_path / "tune.html").write_text("<html>old</html>")

    def full(handle: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files.os, "fsync", full)
    code, _, err = _tune(capsys, tmp_path, *QUICK, "--budget", "1.0")
    assert code == 1
    line = unwrap(err)[-1]
    assert line.startswith("amped: error: Could not write the report")
    assert "No space left on device" in line
    assert (tmp_path / "tuned.json").read_text() == '{"old": true}'
    assert (tmp_path / "tune.html").read_text() == "<html>old</html>"


@pytest.mark.slow
def test_the_script_tunes_a_factory_file(tmp_path):
    """As a user runs it: the installed script, a factory file, a report folder."""
    out = tmp_path / "tuned"
    result = subprocess.run(
        [*LAUNCH, "tune", *QUICK, "--budget", "1.0", "--out", str(out)],
        capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    # One line per verification run: bf16-mixed and the plan (every layer in nvfp4), 2
    # seeds each; no rule saves more than that plan, so none is trained.
    assert "amped tune: verifying: 4/4" in result.stderr
    tuned = _document(out)
    assert tuned["rule"] is None and tuned["source"] == "estimate"
    assert tuned["schema"] == "amped.tune/1"
    model, _, _ = tune_factories.tiny()
    amped.prepare(model, torch.optim.AdamW(model.parameters()), out / "tuned.json")


@pytest.mark.slow
def test_the_builtin_task_is_tuned(capsys, tmp_path, monkeypatch):
    """No --model: compare's built-in tiny GPT, its transformer layers and head (in
    process, from a folder holding no factory)."""
    monkeypatch.chdir(tmp_path)
    code, _, err = _tune(capsys, tmp_path, "--formats", "fp8-rowwise", "--steps", "2",
                         "--seeds", "2", "--budget", "1.0", "--no-progress")  # fmt: skip
    assert code == 0, err
    tuned = _document(tmp_path)
    assert tuned["schema"] == "amped.tune/1"
    assert "head" in tuned["layers"] and "blocks.layers.0.linear1" in tuned["layers"]
    assert "tiny-gpt" in (tmp_path / "tune.html").read_text()


# --- signals ----------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_the_report_renders_still_writes_it(capsys, tmp_path, monkeypatch, signum):
    """In process: the signal arrives after the last progress report, while tune.html
    renders; the pair is still written, whole, and the exit code is 128 + signal."""
    from amped.cli.tune import report as tune_report

    render = tune_report.render_html

    def render_then_signal(tuned, context):
        os.kill(os.getpid(), signum)
        return render(tuned, context)

    monkeypatch.setattr(tune_report, "render_html", render_then_signal)
    code, _, err = _tune(capsys, tmp_path, *QUICK, "--budget", "1.0")
    assert code == 128 + signum, err
    assert "amped: interrupted: the report is written" in err and "Traceback" not in err
    assert _document(tmp_path)["passed"] is True
    assert (tmp_path / "tune.html").read_text().rstrip().endswith("</html>")


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_verifying_stops_with_one_line_and_writes_nothing(tmp_path, signum):
    """The first signal takes effect at the next progress report (after the current
    verification run): exit 128 + signal, one line, and the folder as it was."""
    out = tmp_path / "r"
    out.mkdir()
    (out / "tuned.json").write_text('{"old": true}')
    process = subprocess.Popen(
        [*LAUNCH, "tune", *TINY, "--formats", "fp8-rowwise", "--steps", "40", "--seeds", "3",
         "--budget", "1.0", "--out", str(out)],
        cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert process.stderr is not None
        for line in process.stderr:
            if line.startswith("amped tune: verifying (") or "Traceback" in line:
                break
        process.send_signal(signum)
        _, err = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 128 + signum, err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == "amped: error: interrupted"  # after the progress lines
    assert (out / "tuned.json").read_text() == '{"old": true}'
    assert not (out / "tune.html").exists()


@pytest.mark.slow
def test_a_transformers_gpt2_is_tuned_under_its_module_names(capsys, tmp_path):
    pytest.importorskip("transformers")
    spec = "tests/helpers/tune_factories.py:tiny_gpt2"
    args = ("--model", spec, "--threads", "1", "--no-progress", "--formats", "fp8-rowwise")
    code, _, err = _tune(capsys, tmp_path, *args, "--steps", "2", "--seeds", "2", "--budget", "1")
    assert code == 0, err
    tuned = _document(tmp_path)
    assert "transformer.h.0.attn.c_attn" in tuned["layers"]
    assert "transformer.h.1.mlp.c_proj" in tuned["layers"]
    model, _, _ = tune_factories.tiny_gpt2()
    amped.prepare(model, torch.optim.AdamW(model.parameters()), tmp_path / "tuned.json")
    lowered = [n for n, f in tuned["layers"].items() if f != "bf16"]
    modules = dict(model.named_modules())
    assert lowered
    assert all(type(modules[n]).__name__ not in ("Conv1D", "Linear") for n in lowered)
    assert all(type(modules[n]).__name__ in ("Conv1D", "Linear") for n in tuned["layers"]
               if n not in lowered)  # fmt: skip


@pytest.mark.parametrize(
    ("formats", "expected"),
    [
        ("all,all", list(DEFAULT_FORMATS)),
        ("all,fp8-rowwise", list(DEFAULT_FORMATS)),
        ("mxfp8,ALL", list(DEFAULT_FORMATS)),
        ("mxfp8,fp8-rowwise,mxfp8", ["mxfp8", "fp8-rowwise"]),
    ],
    ids=["all-twice", "all-and-one", "one-and-all", "duplicates"],
)
def test_all_with_other_names_is_every_format(formats, expected):
    # 'all' holds every format, so repeating it or naming a format beside it asks for
    # all of them (before, 'all,all' was refused as the unknown format 'all').
    from amped.cli.tune.command import parse_formats

    assert parse_formats(formats) == expected


def test_all_with_an_unknown_name_names_the_unknown_one(capsys, tmp_path):
    line = _usage_line(capsys, tmp_path / "r", *TINY, "--formats", "all,fp9")
    assert "Unknown format 'fp9'" in line


def test_a_reference_that_diverges_is_said_and_exits_3(capsys, tmp_path):
    # bfloat16-mixed's own loss is inf: no budget can help, and the run says so (before:
    # "no plan meets the budget ... Give a larger budget").
    model = (
        "--model",
        "tests/helpers/tune_factories.py:diverges",
        "--threads",
        "1",
        "--no-progress",
    )
    code, stdout, err = _tune(
        capsys, tmp_path, *model, "--formats", "fp8-rowwise", "--steps", "3", "--seeds", "2"
    )
    assert code == 3, err
    tuned = _document(tmp_path)
    assert tuned["reason"].startswith("the bf16 reference diverged")
    assert "seed(s) 0, 1 of 2" in tuned["reason"]
    assert set(tuned["layers"].values()) == {"bf16"}
    assert "larger budget" not in tuned["reason"]
    assert "amped tune: the bf16 reference diverged" in err and "exit status 3" in err
    assert "The bf16 reference diverged" in " ".join(stdout.split())
