"""``amped verify``, in process: its table fits 80 columns, it writes verify.json
(``amped.verify/1``) and verify.html, and exits 0 clean, 1 flagged, 2 on bad input."""

from __future__ import annotations

import json

import pytest

from amped.cli.main import main

pytest.importorskip("rich")


def _verify(tmp_path, *args):
    return main(["verify", "--out", str(tmp_path / "out"), *args])


def test_a_clean_run_exits_0_with_a_table_in_80_columns_and_its_files(tmp_path, capsys):
    code = _verify(tmp_path, "--model", "verify_helpers:mlp_task", "--recipe", "fp8-rowwise")
    out = capsys.readouterr().out
    assert code == 0
    lines = [line for line in out.splitlines() if not line.startswith("report: ")]  # a path
    assert all(len(line) <= 80 for line in lines)
    assert any(line.split()[:2] == ["2", "grad_weight"] for line in lines if line.strip())
    assert "no flags" in out
    document = json.loads((tmp_path / "out" / "verify.json").read_text())
    assert document["schema"] == "amped.verify/1" and document["flags"] == []
    assert document["backend"] == "amped" and document["recipe"] == "fp8-rowwise"
    assert "<table>" in (tmp_path / "out" / "verify.html").read_text()


@pytest.mark.slow
def test_a_planned_layer_that_never_runs_is_flagged_and_exits_1(tmp_path, capsys):
    code = _verify(tmp_path, "--model", "verify_helpers:unused_layer_task", "--recipe", "mxfp8")
    out = capsys.readouterr().out
    assert code == 1
    document = json.loads((tmp_path / "out" / "verify.json").read_text())
    assert [(f["kind"], f["layer"]) for f in document["flags"]] == [("not_run", "spare")]
    assert "not_run: spare forward" in out


@pytest.mark.parametrize(
    "args",
    [
        ["--recipe", "fp8-delayed"],
        ["--recipe", "mxfp8", "--backend", "jax"],
        ["--recipe", "nvfp4", "--backend", "torchao", "--model", "verify_helpers:mlp_task"],
        ["--recipe", "mxfp8", "--model", "no_such_module_here:build"],
    ],
    ids=["delayed", "unknown-backend", "torchao-has-no-nvfp4", "no-factory"],
)
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, args):
    assert _verify(tmp_path, *args) == 2
    err = capsys.readouterr().err
    assert err.startswith("amped: error:")
