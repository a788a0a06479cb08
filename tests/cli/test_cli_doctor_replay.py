"""``amped doctor --replay BUNDLE``: the replay's summary and exit status, in process."""

from __future__ import annotations

import json

import pytest
from recorder_helpers import record_mlp_underflow

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
