"""Every command's output fits 80 columns when piped: tables, sentences, --help and
errors (README, "Output"). In process, stdout and stderr captured (not a terminal, as
on a pipe), ``COLUMNS`` 80 as a pipe leaves argparse and rich; the report folder a
short relative path (a path longer than a line is printed whole)."""

from __future__ import annotations

import contextlib

import pytest

pytest.importorskip("rich")
pytest.importorskip("matplotlib")

from cli_fault_helpers import ROOT

from amped.cli.main import main

WIDTH = 80
CLI = str(ROOT / "tests" / "cli_factories.py")
TUNE = str(ROOT / "tests" / "tune_factories.py")
QUICK_TUNE = ["--model", f"{TUNE}:tiny", "--threads", "1", "--no-progress", "--formats",
              "fp8-rowwise,nvfp4", "--steps", "3", "--seeds", "2", "--budget", "1.0"]  # fmt: skip


@pytest.fixture(autouse=True)
def _piped(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", str(WIDTH))


def _wide_lines(capsys, *argv: str) -> list[str]:
    with contextlib.suppress(SystemExit):  # --help exits
        main(list(argv))
    captured = capsys.readouterr()
    return [line for line in (captured.out + captured.err).splitlines() if len(line) > WIDTH]


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["--help"], id="help"),
        pytest.param(["compare", "--help"], id="compare-help"),
        pytest.param(["doctor", "--help"], id="doctor-help"),
        pytest.param(["tune", "--help"], id="tune-help"),
        pytest.param(["compare", "--recipes", "mxfp8,nope"], id="compare-error"),
        pytest.param(
            ["compare", "--model", f"{CLI}:odd_dims", "--recipes", "mxfp8"], id="no-layer-error"
        ),
        pytest.param(["tune", "--model", f"{TUNE}:no_eligible_layer"], id="tune-error"),
        pytest.param(["doctor", "--loss-scale", "-1"], id="doctor-error"),
    ],
)
def test_help_and_errors_fit_80_columns(capsys, argv):
    assert _wide_lines(capsys, *argv) == []


@pytest.mark.parametrize(
    "factory", ["long_module_names", "backward_overflow", "wide_gradient_range", "two_overflows"]
)
def test_doctor_output_fits_80_columns(capsys, factory):
    scale = [] if factory == "backward_overflow" else ["--loss-scale", "1"]
    assert _wide_lines(capsys, "doctor", "--model", f"doctor_factories:{factory}", *scale) == []


def test_compare_output_fits_80_columns(capsys):
    argv = ["compare", "--model", f"{CLI}:good", "--recipes", "fp32,bf16,mxfp8", "--steps",
            "3", "--max-time", "60", "--threads", "1", "--no-progress", "--peak-memory",
            "in-process"]  # fmt: skip
    assert _wide_lines(capsys, *argv) == []


def test_tune_output_fits_80_columns(capsys):
    assert _wide_lines(capsys, "tune", *QUICK_TUNE) == []
