"""`amped compare` end to end, in subprocesses as a user runs it: the default task with
every recipe, the report (rendered in headless Chromium where it is installed), the
example factory, determinism across processes, and Ctrl-C writing partial results.
The report in a browser: tests/cli/test_browser.py."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from repo_paths import ROOT
from results_schema import validate

from amped.cli.main import main
from amped.recipes.registry import RECIPES

pytestmark = pytest.mark.xdist_group("e2e")  # one worker builds the module's run

pytest.importorskip("rich")
pytest.importorskip("matplotlib")

# One thread keeps the subprocesses fast and their timings sane on a busy 2-core machine.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
SMALL = ("--batch-size", "8", "--threads", "1", "--max-time", "0", "--peak-memory", "in-process")

pytestmark = pytest.mark.slow


def _amped(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "amped", "compare", *args]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=ENV
    )


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    result = _amped("--steps", "3", *SMALL, "--out", str(out), "--json", "--no-progress")
    return result, out


def test_default_run_exits_0_and_prints_only_json(default_run):
    result, out = default_run
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == json.loads((out / "results.json").read_text())


def test_results_match_the_schema_and_hold_every_recipe(default_run):
    _, out = default_run
    results = json.loads((out / "results.json").read_text())
    assert validate(results) == []
    assert [r["name"] for r in results["recipes"]] == list(RECIPES)  # fp32 is first
    assert results["partial"] is False
    assert results["task"]["name"] == "tiny-gpt-stdlib"
    for recipe in results["recipes"]:
        assert recipe["status"] == "complete", recipe
        assert recipe["steps_done"] == 3
        assert all(isinstance(v, float) for v in recipe["losses"])
        assert recipe["memory"]["bytes_per_param"] > 0
        assert set(recipe["eval"]) == {"loss", "accuracy"}
        if recipe["loss_scaling"]:
            assert len(recipe["loss_scales"]) == 3
            assert recipe["final_loss_scale"] > 0


def _images(page: str) -> list[bytes]:
    marker = 'src="data:image/png;base64,'
    chunks = page.split(marker)[1:]
    return [base64.b64decode(chunk.split('"', 1)[0]) for chunk in chunks]


def test_report_is_one_file_with_embedded_plots(default_run):
    _, out = default_run
    page = (out / "report.html").read_text()
    images = _images(page)
    assert len(images) == 4  # loss curves, loss scale, throughput, memory
    assert all(png.startswith(b"\x89PNG\r\n\x1a\n") for png in images)
    assert "http://" not in page and "https://" not in page and "<script" not in page
    for name in RECIPES:
        assert f'<td class="recipe">{name}</td>' in page


def test_example_factory_runs(tmp_path):
    spec = "examples/compare_factory.py:build"
    args = ("--model", spec, "--recipes", "fp32,bf16", "--steps", "3", "--max-time", "0")
    # This interpreter loads the example by its path already; own-process probes of a
    # factory file are tested in test_cli_timing.py.
    args += ("--peak-memory", "in-process")
    result = _amped(*args, "--out", str(tmp_path), "--no-progress")
    assert result.returncode == 0, result.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert validate(results) == []
    assert [r["name"] for r in results["recipes"]] == ["fp32", "bf16-mixed"]
    assert results["task"]["factory"] == spec
    assert results["task"]["name"] == "compare_factory:build"
    assert "fp32" in result.stdout and "bf16-mixed" in result.stdout  # the table


def test_same_seed_same_fp32_losses_across_processes(tmp_path, capsys):
    args = ("--recipes", "fp32", "--steps", "4", *SMALL, "--no-progress")
    # One run in a fresh interpreter, the others in this one (which has run other tests).
    result = _amped(*args, "--seed", "7", "--out", str(tmp_path / "a"))
    assert result.returncode == 0, result.stderr
    there = json.loads((tmp_path / "a" / "results.json").read_text())["recipes"][0]
    runs = {}
    for seed in ("7", "8"):
        assert (
            main(["compare", *args, "--seed", seed, "--out", str(tmp_path / seed), "--json"]) == 0
        )
        runs[seed] = json.loads(capsys.readouterr().out)["recipes"][0]
    assert runs["7"]["losses"] == there["losses"]
    assert runs["7"]["eval"] == there["eval"]
    assert runs["8"]["losses"] != there["losses"]  # another seed gives other losses


def test_sigint_writes_partial_results(tmp_path):
    args = ("--recipes", "fp32,bf16", "--steps", "100000", *SMALL, "--no-progress")
    command = [sys.executable, "-m", "amped", "compare", *args, "--out", str(tmp_path)]
    process = subprocess.Popen(
        command, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert process.stderr is not None
        line = process.stderr.readline()  # "fp32: running 100000 steps"
        assert line.startswith("fp32: running"), line
        time.sleep(2.0)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert validate(results) == []
    assert results["partial"] is True
    fp32, bf16 = results["recipes"]
    assert fp32["status"] == "interrupted" and fp32["steps_done"] > 0
    assert bf16["status"] == "not_run" and bf16["steps_done"] == 0
    assert "Partial results" in (tmp_path / "report.html").read_text()
    assert "(partial)" in stdout


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "amped"
    found = str(script) if script.exists() else shutil.which("amped")
    if found is None:
        pytest.skip("the amped console script is not installed in this environment")
    result = subprocess.run([found, "compare", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    assert "--model MODULE:FACTORY" in result.stdout
