"""Bad input to `amped compare` gets its exit code and a one-line message, no traceback.

In process (fast): main() is called with argv and its stderr read. One case runs the
installed entry point in a subprocess to show the same holds end to end.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from cli_fault_helpers import unwrap
from repo_paths import HELPERS, ROOT

from amped.cli.main import main

pytest.importorskip("rich")
pytest.importorskip("matplotlib")

FACTORIES = HELPERS / "cli_factories.py"


def _compare(capsys, tmp_path, *args: str) -> tuple[int, str]:
    out = str(tmp_path / "out")
    code = main(["compare", "--out", out, "--max-time", "0", "--peak-memory", "in-process", *args])
    err = capsys.readouterr().err
    return code, err


def _one_line(err: str) -> str:
    lines = [line for line in unwrap(err) if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("amped: error: ")
    return lines[0]


def test_an_unknown_recipe_suggests_the_closest_and_is_received_once(capsys, tmp_path):
    code, err = _compare(capsys, tmp_path, "--recipes", "fp32,mxfp9")
    assert code == 2
    line = _one_line(err)
    assert "Unknown recipe 'mxfp9'; did you mean 'mxfp8'?" in line
    assert "()" not in line and ", mxfp8, " in line  # no empty alias list
    assert line.count("Received:") == 1 and line.endswith("Received: --recipes 'fp32,mxfp9'")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        pytest.param(["--recipes", "fp8"], "Unknown recipe 'fp8'", id="unknown-recipe"),
        pytest.param(["--recipes", " , "], "names no recipe", id="empty-recipes"),
        pytest.param(["--model", "no_colon"], "takes module:factory", id="spec-no-colon"),
        pytest.param(["--model", "no_such_module_xyz:build"], "No module named", id="no-module"),
        pytest.param(["--model", "missing_file.py:build"], "No file", id="no-file"),
        pytest.param(["--model", f"{FACTORIES}:nope"], "has no attribute 'nope'", id="no-attr"),
        pytest.param(["--model", f"{FACTORIES}:NOT_CALLABLE"], "callable", id="not-callable"),
        pytest.param(["--device", "tpu:0:1"], "--device must be a torch device", id="bad-device"),
        pytest.param(["--device", "meta"], "is not available", id="unsupported-device"),
        pytest.param(["--steps", "0"], "positive integer", id="steps-zero"),
        pytest.param(["--max-time", "-1"], "expected seconds", id="negative-time"),
        pytest.param(["--bogus"], "unrecognized arguments", id="unknown-flag"),
        pytest.param(["--module-filter", "h.0,("], "is not a regular expression", id="bad-re"),
        pytest.param(["--exclude", " , "], "--exclude names no layer", id="empty-exclude"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(capsys, tmp_path, args, expected):
    code, err = _compare(capsys, tmp_path, *args)
    assert code == 2
    assert expected in _one_line(err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_cuda_exits_2(capsys, tmp_path):
    code, err = _compare(capsys, tmp_path, "--device", "cuda")
    assert code == 2
    assert "'cuda' is not available" in _one_line(err)


@pytest.mark.parametrize(
    ("factory", "expected"),
    [
        pytest.param("returns_tensor", "must return (model, batches, loss_fn)", id="tensor"),
        pytest.param("returns_pair", "Received: a tuple of 2 items", id="pair"),
        pytest.param("returns_no_module", "torch.nn.Module", id="no-module"),
        pytest.param("batches_not_pairs", "(inputs, targets) pair", id="batch-not-pair"),
        pytest.param("loss_not_scalar", "scalar tensor", id="loss-not-scalar"),
    ],
)
def test_factory_breaking_the_contract_exits_2(capsys, tmp_path, factory, expected):
    code, err = _compare(capsys, tmp_path, "--model", f"{FACTORIES}:{factory}", "--steps", "2")
    assert code == 2
    assert expected in _one_line(err)


def test_batch_size_for_a_factory_without_one_exits_2(capsys, tmp_path):
    spec = f"{FACTORIES}:no_batch_size"
    code, err = _compare(capsys, tmp_path, "--model", spec, "--batch-size", "4")
    assert code == 2
    assert "takes no batch_size" in _one_line(err)


def test_out_that_is_a_file_exits_2(capsys, tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    code = main(["compare", "--out", str(target), "--recipes", "fp32"])
    assert code == 2
    assert "must be a folder" in _one_line(capsys.readouterr().err)


def test_a_task_that_cannot_run_exits_1_before_training(capsys, tmp_path):
    code, err = _compare(capsys, tmp_path, "--model", f"{FACTORIES}:raises_in_forward")
    assert code == 1
    line = _one_line(err)
    assert "failed before training" in line
    assert "RuntimeError: this model cannot run" in line


@pytest.mark.slow
def test_a_recipe_that_raises_fails_the_run_with_exit_1(capsys, tmp_path):
    spec = f"{FACTORIES}:fails_in_low_precision"
    args = ("--model", spec, "--recipes", "fp32,bf16,fp16", "--steps", "2", "--no-progress")
    code, err = _compare(capsys, tmp_path, *args)
    assert code == 1
    error_lines = [line for line in unwrap(err) if "error" in line]
    assert len(error_lines) == 1, err
    assert "2 recipe(s) failed" in error_lines[0]
    assert "RuntimeError: this model refuses autocast" in error_lines[0]
    assert "Traceback" not in err
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["status"] for r in results["recipes"]] == ["complete", "failed", "failed"]


def test_traceback_flag_prints_the_failure(capsys, tmp_path):
    spec = f"{FACTORIES}:fails_in_low_precision"
    args = ("--model", spec, "--recipes", "bf16", "--steps", "2", "--traceback")
    code, err = _compare(capsys, tmp_path, *args)
    assert code == 1
    assert "Traceback" in err
    assert "refuses autocast" in err


def test_no_command_exits_2(capsys):
    assert main([]) == 2
    assert "name a command" in _one_line(capsys.readouterr().err)


@pytest.mark.slow
def test_installed_entry_point_reports_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "amped", "compare", "--recipes", "fp8", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert "Unknown recipe 'fp8'" in _one_line(result.stderr)
