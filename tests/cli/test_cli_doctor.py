"""``amped doctor``: the built-in task is healthy, a broken factory is named, and bad
input gets a one-line error with exit code 2.

In process (fast): main() is called with argv and its output read. One test runs the
installed entry point in a subprocess to show the same holds end to end.
"""

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
from cli_fault_helpers import unwrap
from repo_paths import HELPERS

from amped.cli.main import main

pytest.importorskip("rich")
pytest.importorskip("matplotlib")


def _doctor(capsys, tmp_path: Path, *args: str) -> tuple[int, str, str]:
    """``amped doctor`` in process, its report in ``tmp_path/rep``: (exit code, out, err)."""
    code = main(["doctor", "--out", str(tmp_path / "rep"), *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _report(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "rep" / "doctor.json").read_text())


@pytest.mark.slow
def test_doctor_on_the_builtin_task_is_healthy(tmp_path):
    path = os.pathsep.join(p for p in (str(HELPERS), os.environ.get("PYTHONPATH")) if p)
    result = subprocess.run(
        [sys.executable, "-m", "amped", "doctor", "--out", "rep", "--json"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["healthy"] is True and data["dtype"] == "float16"
    assert (tmp_path / "rep" / "doctor.html").read_text().count("data:image/png;base64,") == 1
    assert json.loads((tmp_path / "rep" / "doctor.json").read_text()) == data


def test_doctor_names_the_culprit_of_a_user_factory(capsys, tmp_path):
    code, out, err = _doctor(capsys, tmp_path, "--model", "doctor_factories:exp_overflow")
    assert code == 0, err
    assert "first non-finite value, forward: exp in head" in " ".join(out.split())
    data = _report(tmp_path)
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
        (["--batch-size", "0"], "argument --batch-size: expected a positive integer, got '0'"),
        (["--batch-size", "two"], "argument --batch-size: expected a positive integer"),
        (["--seed", "x"], "argument --seed: expected an integer in [0, 2**64 - 1]"),
    ],
    ids=["bad-model", "bad-dtype", "bad-scale", "bad-device", "zero-batch", "word-batch",
         "bad-seed"],
)  # fmt: skip
def test_bad_input_exits_2_with_one_line(capsys, tmp_path, args, message):
    code, out, err = _doctor(capsys, tmp_path, *args)
    assert code == 2
    lines = unwrap(err.strip())
    assert len(lines) == 1 and lines[0].startswith("amped: error:") and message in lines[0]
    assert out == "" and not (tmp_path / "rep").exists()  # refused before anything ran


@pytest.mark.parametrize("command", ["compare", "doctor"])
@pytest.mark.parametrize("flag", ["--batch-size", "--seed"])
def test_both_commands_refuse_the_same_values_with_the_same_message(capsys, flag, command):
    value = "0" if flag == "--batch-size" else "1.5"
    assert main([command, flag, value]) == 2
    message = capsys.readouterr().err.strip().partition("(see")[0]
    assert message.startswith(f"amped: error: argument {flag}: ")
    other = "doctor" if command == "compare" else "compare"
    assert main([other, flag, value]) == 2
    assert capsys.readouterr().err.strip().partition("(see")[0] == message


@pytest.mark.parametrize(
    ("spelling", "dtype"),
    [("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16), ("torch.bfloat16", torch.bfloat16),
     ("float16", torch.float16), ("fp16", torch.float16), ("half", torch.float16)],
)  # fmt: skip
def test_dtype_takes_torch_names_and_short_aliases(spelling, dtype):
    from amped.comparison.dtypes import parse_low_dtype

    assert parse_low_dtype(spelling) is dtype


def test_doctor_runs_bfloat16_spelled_as_torch_spells_it(capsys, tmp_path):
    args = ("--model", "doctor_factories:exp_overflow", "--json", "--dtype", "bfloat16")
    code, out, err = _doctor(capsys, tmp_path, *args)
    assert code == 0, err
    assert json.loads(out)["dtype"] == "bfloat16"
    assert json.loads(out) == _report(tmp_path)


def test_bfloat16_summary_has_no_loss_scale_lines(capsys, tmp_path):
    args = ("--model", "doctor_factories:exp_overflow")
    code, out, err = _doctor(capsys, tmp_path, *args, "--dtype", "bf16")
    assert code == 0, err
    assert "loss scale" not in out  # bfloat16 has float32's range: nothing to scale
    _, float16, _ = _doctor(capsys, tmp_path, *args)
    assert "loss scale 65536" in float16  # the control: float16 reports its scale


def test_an_unfixed_nonfinite_value_exits_3_like_a_linter(capsys, tmp_path):
    code, _, err = _doctor(capsys, tmp_path, "--model", "doctor_factories:two_overflows")
    assert code == 3, err
    assert "no verified fix: exit status 3" in err
    data = _report(tmp_path)
    assert data["forward_culprit"] is not None and not data["suggestion"]["verified"]


def test_doctor_table_fits_80_columns_with_one_line_per_op():
    import doctor_factories
    from rich.console import Console

    from amped.cli.doctor.command import doctor_table
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

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--version"]) == 0
    assert out.getvalue() == f"amped {__version__} (torch {torch.__version__}, Python " \
        f"{sys.version.split()[0]})\n"  # fmt: skip


def test_missing_extra_names_the_command_that_needs_it(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    assert main(["doctor"]) == 1
    assert "amped doctor needs the optional 'cli' dependencies (matplotlib missing)" in (
        " ".join(unwrap(capsys.readouterr().err))
    )


def test_the_printed_fix_line_executed_builds_the_policy_it_verified(capsys, tmp_path):
    import amped
    from amped.doctor import diagnose

    code, out, err = _doctor(capsys, tmp_path, "--model", "doctor_factories:exp_overflow")
    assert code == 0, err
    (line,) = [line.strip() for line in out.splitlines() if line.strip().startswith("fix: ")]
    fix = line.removeprefix("fix: ")
    assert _report(tmp_path)["suggestion"]["code"] == fix
    assert "fix" in (tmp_path / "rep" / "doctor.html").read_text()
    policy = eval(fix, {"amped": amped})  # what a user pastes after `import amped`
    assert policy == amped.Policy.preset("torch", "cpu").with_ops(fp32=["exp"])
    import doctor_factories

    model, batches, loss_fn = doctor_factories.exp_overflow()
    x, _ = next(iter(batches))
    fixed = diagnose(model, x, lambda out: loss_fn(out, None), dtype=torch.float16, policy=policy)
    assert fixed.forward_culprit is None  # the forward overflow is gone


def test_a_backward_overflow_dynamic_scaling_absorbs_exits_0_and_the_fix_skips_no_step(
    capsys, tmp_path
):
    import doctor_factories

    import amped

    code, out, err = _doctor(capsys, tmp_path, "--model", "doctor_factories:backward_overflow")
    assert code == 0, err
    text = " ".join(out.split())
    assert "absorbed by dynamic loss scaling (first safe scale 8192)" in text
    assert "largest safe loss scale: 8192" in text and "not found" not in text
    (line,) = [line.strip() for line in out.splitlines() if line.strip().startswith("fix: ")]
    fix = line.removeprefix("fix: ")
    assert fix == "amped.GradScaler('cpu', init_scale=8192.0)"
    suggestion = _report(tmp_path)["suggestion"]
    assert suggestion["verified"] and suggestion["absorbed"] and suggestion["why_not"] is None

    def skipped(scaler) -> int:
        """A plain fp16 loop on the doctor's batches: the steps ``scaler`` skips."""
        model, batches, loss_fn = doctor_factories.backward_overflow()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        skips = 0
        for (x, y), _ in zip(batches, range(4), strict=False):
            with amped.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(model(x), y)
            optimizer.zero_grad()
            before = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            skips += scaler.get_scale() < before
        return skips

    assert skipped(eval(fix, {"amped": amped})) == 0  # the pasted line
    assert skipped(amped.GradScaler("cpu")) > 0  # the control: 65536 skips


def test_a_scale_that_does_not_verify_says_why(capsys, tmp_path):
    args = ("--model", "doctor_factories:wide_gradient_range", "--loss-scale", "1")
    code, out, err = _doctor(capsys, tmp_path, *args)
    assert code == 0, err  # nothing non-finite: underflow alone is no failure
    text = " ".join(out.split())
    assert "suggestion: not found: scale the loss by 8192" in text
    why = "at scale 8192, the largest without overflow, gradient small.weight still loses"
    assert why in text
    assert _report(tmp_path)["suggestion"]["why_not"].startswith(why)
