"""``amped doctor`` end to end: the built-in task is healthy, a broken factory is named,
and bad input gets a one-line error with exit code 2."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("rich")
TESTS = Path(__file__).resolve().parent


def _doctor(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
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
        (
            ["--dtype", "fp32"],
            "--dtype must be a low-precision dtype: float16/fp16/half, bfloat16/bf16",
        ),
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


@pytest.mark.parametrize(
    ("spelling", "dtype"),
    [("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16), ("torch.bfloat16", torch.bfloat16),
     ("float16", torch.float16), ("fp16", torch.float16), ("half", torch.float16)],
)  # fmt: skip
def test_dtype_takes_torch_names_and_short_aliases(spelling, dtype):
    from amped.cli.dtypes import parse_low_dtype

    assert parse_low_dtype(spelling) is dtype


def test_doctor_runs_bfloat16_spelled_as_torch_spells_it(tmp_path):
    args = ("--model", "doctor_factories:exp_overflow", "--out", "rep", "--json")
    result = _doctor(*args, "--dtype", "bfloat16", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["dtype"] == "bfloat16"


def test_bfloat16_summary_has_no_loss_scale_lines(tmp_path):
    args = ("--model", "doctor_factories:exp_overflow", "--out", "rep", "--dtype", "bf16")
    result = _doctor(*args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "loss scale" not in result.stdout  # bfloat16 has float32's range: nothing to scale
    float16 = _doctor("--model", "doctor_factories:exp_overflow", "--out", "rep", cwd=tmp_path)
    assert "loss scale 65536" in float16.stdout  # the control: float16 reports its scale


def test_an_unfixed_nonfinite_value_exits_3_like_a_linter(tmp_path):
    result = _doctor("--model", "doctor_factories:two_overflows", "--out", "rep", cwd=tmp_path)
    assert result.returncode == 3, result.stderr
    assert "no verified fix: exit status 3" in result.stderr
    data = json.loads((tmp_path / "rep" / "doctor.json").read_text())
    assert data["forward_culprit"] is not None and not data["suggestion"]["verified"]


def test_doctor_table_fits_80_columns_with_one_line_per_op():

    from rich.console import Console

    import doctor_factories
    from amped.cli.doctor import doctor_table
    from amped.doctor import diagnose

    model, batches, loss_fn = doctor_factories.long_module_names()
    x, _ = next(iter(batches))
    report = diagnose(model, x, lambda out: loss_fn(out, None), dtype=torch.float16)
    for width in (80, 160):
        console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
        console.print(doctor_table(report, width=width))
        lines = console.export_text().splitlines()
        assert all(len(line) <= width for line in lines)
        body = [line for line in lines if "fp16" in line or "fp32" in line]
        assert len(body) == len(report.ops)  # one line per op: nothing wrapped
        for line, op in zip(body, report.ops, strict=True):
            assert op.op in line and f"{op.amax:.3g}" in line
    assert "transformer_encoder_layers_11.self_attention_query_key_value" in body[0]


def test_version_prints_amped_and_torch():
    from amped import __version__
    from amped.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--version"]) == 0
    assert out.getvalue() == f"amped {__version__} (torch {torch.__version__}, Python " \
        f"{sys.version.split()[0]})\n"  # fmt: skip


def test_missing_extra_names_the_command_that_needs_it(tmp_path):
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from amped.cli.main import main\n"
        "sys.exit(main(['doctor']))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=tmp_path, timeout=120)  # fmt: skip
    assert result.returncode == 1
    assert "amped doctor needs the optional 'cli' dependencies (matplotlib missing)" in (
        result.stderr
    )
