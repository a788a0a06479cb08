"""``amped doctor --replay BUNDLE``: the replay's summary and exit status, in process."""

from __future__ import annotations

import json

import pytest
from recorder_helpers import record_mlp_nvfp4_underflow, record_mlp_underflow

from amped.cli.main import main

pytest.importorskip("rich")
pytest.importorskip("matplotlib")


def test_replay_prints_the_fix_and_exits_by_what_it_found(tmp_path, capsys):
    capture, failure = record_mlp_underflow(tmp_path)
    assert main(["doctor", "--replay", str(failure)]) == 0
    out = capsys.readouterr().out
    assert "first non-finite reproduced: 2 grad_input GEMM, its grad_output" in out
    assert "fix: grad_input of 2 with dynamic scaling instead of delayed: finite" in out
    assert main(["doctor", "--replay", str(capture), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["replayed"] is None and all(result["bitwise"].values())
    assert main(["doctor", "--replay", str(capture), "--recipe", "nvfp4"]) == 2
    assert "recorded under recipe 'fp8-delayed', not 'nvfp4'" in capsys.readouterr().err


def test_replay_of_a_total_underflow_shows_it_and_its_fix(tmp_path, capsys):
    (_, failure), _, _ = record_mlp_nvfp4_underflow(tmp_path)
    assert main(["doctor", "--replay", str(failure)]) == 0
    out = capsys.readouterr().out
    assert "first total underflow reproduced: 0 forward GEMM, its input (values element" in out
    assert "  element format: in mxfp8: flushed to zero" in out
    assert "fix: forward of 0 forward in bfloat16: its input not flushed to zero, finite" in out
    assert main(["doctor", "--replay", str(failure), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["reason"] == "underflow" and result["replayed"] == result["recorded"]
    flushed = {trial["part"]: trial["flushed"] for trial in result["trials"]}
    assert flushed["element format"] and not flushed["role"]
