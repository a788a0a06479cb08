"""``amped doctor`` end to end: the built-in task is healthy, a broken factory is named,
and bad input gets a one-line error with exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("rich")
TESTS = Path(__file__).resolve().parent


def _doctor(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    return subprocess.run(
        [sys.executable, "-m", "amped", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=env,
    )


@pytest.mark.slow
def test_doctor_on_the_builtin_task_is_healthy(tmp_path):
    result = _doctor("--out", "rep", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["healthy"] is True and data["dtype"] == "float16"
    assert (tmp_path / "rep" / "doctor.html").read_text().count("data:image/png;base64,") == 1
    assert json.loads((tmp_path / "rep" / "doctor.json").read_text()) == data


def test_doctor_names_the_culprit_of_a_user_factory(tmp_path):
    result = _doctor("--model", "doctor_factories:exp_overflow", "--out", "rep", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "first non-finite value, forward: exp in head" in " ".join(result.stdout.split())
    data = json.loads((tmp_path / "rep" / "doctor.json").read_text())
    assert data["forward_culprit"]["op"] == "exp" and data["suggestion"]["verified"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "no_such_module:build"], "--model"),
        (["--dtype", "fp32"], "invalid choice"),
        (["--loss-scale", "0"], "--loss-scale must be > 0"),
        (["--device", "tpu"], "--device"),
    ],
    ids=["bad-model", "bad-dtype", "bad-scale", "bad-device"],
)
def test_bad_input_exits_2_with_one_line(tmp_path, args, message):
    result = _doctor(*args, cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("amped: error:") and message in lines[0]
