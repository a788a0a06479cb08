"""benchmarks/gpu_check.sh: its CPU dry run writes the whole JSON, and a failing part
is recorded without stopping the run.

The dry run is the same driver as on the GPU (benchmarks/support/gpu_check.py), on the CPU with
the benchmarks' smallest settings: the CUDA parts skip, the benchmarks run, and every
section and target is there with values of the right types.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from repo_paths import ROOT

pytestmark = pytest.mark.xdist_group("gpu_check")  # one worker runs the dry run

DRIVER = ROOT / "benchmarks" / "support" / "gpu_check.py"
PARTS = ("setup", "op_lists", "gpu_tests", "recipes", "fp8", "autocast_overhead")
PARTS += ("scaler_overhead",)
TARGETS = ("bf16_mixed_over_torch_o1", "bf16_master_over_torch_o1", "fp8_speedup_over_bf16")
COUNTS = ("passed", "failed", "errors", "skipped")


def _driver():
    spec = importlib.util.spec_from_file_location("gpu_check", DRIVER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(tmp: Path, *args: str, dry_env: bool = False) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp / "check.json"
    env = dict(os.environ, AMPED_GPU_CHECK_DRY_RUN="1") if dry_env else None
    command = [sys.executable, str(DRIVER), "--out", str(out), "--work", str(tmp / "work")]
    done = subprocess.run([*command, *args], capture_output=True, text=True, env=env)
    return done, json.loads(out.read_text())


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    if torch.cuda.is_available():
        pytest.skip("the dry run's expectations (CUDA parts skipped) hold without CUDA")
    done, report = _run(tmp_path_factory.mktemp("gpu_check"), dry_env=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return report


@pytest.mark.slow
def test_dry_run_writes_every_section(dry_run):
    assert dry_run["dry_run"] is True and dry_run["ok"] is True
    assert set(PARTS) | {"environment", "targets", "seconds", "ok", "dry_run"} == set(dry_run)
    env = dry_run["environment"]
    assert env["device"] == "cpu" and env["cuda_available"] is False and env["gpu"] is None
    assert env["torch"] == torch.__version__
    assert isinstance(env["amped_commit"], str) and len(env["amped_commit"]) == 40
    assert dry_run["setup"]["status"] == "skipped" and "dry run" in dry_run["setup"]["reason"]
    for name in PARTS[1:]:
        section = dry_run[name]
        assert isinstance(section["seconds"], float) and section["returncode"] in (0, 5)
        assert isinstance(section["command"], list) and section["command"]


@pytest.mark.slow
def test_dry_run_skips_the_cuda_tests_cleanly(dry_run):
    op_lists = dry_run["op_lists"]
    assert op_lists["status"] == "skipped"
    assert {key: op_lists["tests"][key] for key in COUNTS} == dict.fromkeys(COUNTS, 0) | {
        "skipped": 1
    }
    assert op_lists["tests"]["skips"][0]["reason"].endswith("needs CUDA")
    gpu_tests = dry_run["gpu_tests"]
    assert gpu_tests["status"] == "skipped" and gpu_tests["tests"]["failures"] == []
    assert all(isinstance(gpu_tests["tests"][key], int) for key in COUNTS)


@pytest.mark.slow
def test_dry_run_records_each_benchmarks_figures(dry_run):
    recipes = dry_run["recipes"]["figures"]
    assert recipes["device"] == "cpu"
    (model,) = recipes["models"].values()
    assert set(model["ratios"]) == {"casts", "amped bf16-mixed", "bf16-master", "bf16-pure"}
    assert all(isinstance(v, float) and v > 0 for v in model["ratios"].values())
    fp8 = dry_run["fp8"]["figures"]
    assert fp8["gpu"] is None and fp8["gpu_ran"] is False and fp8["gpu_block"] is None
    assert set(fp8["cpu"]) == {"fp8-tensorwise", "fp8-rowwise", "fp8-rowwise-gw-hp", "fp8-delayed"}
    autocast = dry_run["autocast_overhead"]["figures"]
    assert set(autocast["train_step_ratio"]) == {"cnn"} and autocast["compiled_ratio"] is None
    assert isinstance(autocast["per_call_us"]["listed op (F.linear)"]["engine"], float)
    scalers = dry_run["scaler_overhead"]["figures"]["scalers"]
    assert set(scalers) == {"default", "hysteresis+bounds", "record_history"}
    assert isinstance(scalers["default"]["1000"]["ratio"], float)


@pytest.mark.slow
def test_dry_run_evaluates_every_target(dry_run):
    targets = dry_run["targets"]
    assert set(targets) == set(TARGETS)
    for name in TARGETS[:2]:
        entry = targets[name]
        assert isinstance(entry["value"], float) and isinstance(entry["met"], bool)
        assert entry["met"] == (entry["value"] <= entry["target"]) and entry["reason"] is None
        assert entry["note"].startswith("dry run")
    fp8 = targets["fp8_speedup_over_bf16"]
    assert fp8["value"] is None and fp8["met"] == "not measured"
    assert "capability >= 8.9" in fp8["reason"]
    assert (fp8["target"], fp8["compare"]) == (1.3, ">=")


@pytest.mark.slow
def test_a_part_out_of_time_is_recorded_and_the_run_goes_on(tmp_path):
    done, report = _run(
        tmp_path, "--dry-run", "--parts", "recipes,scaler_overhead", "--budget", "recipes=1"
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert report["ok"] is False
    assert report["recipes"]["status"] == "timeout" and report["recipes"]["seconds"] < 30
    assert report["recipes"]["returncode"] == -9  # killed, with its process group
    assert report["scaler_overhead"]["status"] == "passed"  # the part after it ran
    assert report["fp8"] == {"status": "not run", "reason": "not chosen by --parts"}
    assert targets_not_measured(report, "bf16_mixed_over_torch_o1", "part 'recipes' timeout")
    assert targets_not_measured(report, "fp8_speedup_over_bf16", "part 'fp8' not run")


def targets_not_measured(report: dict, name: str, reason: str) -> bool:
    entry = report["targets"][name]
    return entry["met"] == "not measured" and entry["value"] is None and entry["reason"] == reason


def test_a_failing_script_is_recorded_with_its_output(tmp_path):
    gpu_check = _driver()
    part = gpu_check.Part("recipes", "script", ("-c", "raise SystemExit('no figures here')"), 60)
    section = gpu_check.run_part(part, 60, tmp_path, gpu_check.child_env(None))
    assert section["status"] == "failed" and section["returncode"] == 1
    assert section["figures"] is None and "no figures here" in section["output_tail"]
    assert isinstance(section["cpu_seconds"], float) and section["cpu_seconds"] >= 0


def test_a_failing_test_is_counted_with_its_message(tmp_path):
    gpu_check = _driver()
    test = tmp_path / "test_planted.py"
    test.write_text("def test_fails():\n    assert 1 == 2, 'planted'\n\ndef test_ok():\n    pass\n")
    part = gpu_check.Part("gpu_tests", "pytest", ("-m", "pytest", "-q", str(test)), 120)
    section = gpu_check.run_part(part, 120, tmp_path, gpu_check.child_env(None))
    assert section["status"] == "failed"
    assert {key: section["tests"][key] for key in COUNTS} == {
        "passed": 1,
        "failed": 1,
        "errors": 0,
        "skipped": 0,
    }
    (failure,) = section["tests"]["failures"]
    assert failure["test"].endswith("::test_fails") and "planted" in failure["message"]


def test_targets_compare_each_figure_with_its_target():
    targets = _driver().evaluate
    ratios = {"amped bf16-mixed": 1.0, "bf16-master": 0.98, "casts": 0.1, "bf16-pure": 0.9}
    report = {
        "environment": {"gpu": "NVIDIA H200"},
        "recipes": {"status": "passed", "figures": {"models": {"a": {"ratios": ratios}}}},
        "fp8": {"status": "passed", "figures": {"gpu": {"fp8-tensorwise": {"speedup/bf16": 1.4}}}},
    }
    result = targets(report)
    assert [result[name]["met"] for name in TARGETS] == [True, False, True]
    assert [result[name]["value"] for name in TARGETS] == [1.0, 0.98, 1.4]
    assert all(result[name]["note"] is None for name in TARGETS)
    worse = {**ratios, "amped bf16-mixed": 1.02}
    report["recipes"]["figures"]["models"]["b"] = {"ratios": worse}
    assert targets(report)["bf16_mixed_over_torch_o1"]["value"] == 1.02  # the worst model's
