"""Every FP8/block recipe is checked against the model before anything trains: the dry
run's conversion in results.json, ``--module-filter`` and ``--exclude``, and a recipe
that converts no layer stopping with exit 2, the report folder untouched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("rich")
pytest.importorskip("matplotlib")

import cli_factories
from cli_fault_helpers import unwrap
from repo_paths import HELPERS
from results_schema import validate

from amped.cli.main import main

FACTORIES = HELPERS / "cli_factories.py"


def _compare(tmp_path: Path, factory: str, *args: str) -> int:
    return main(["compare", "--model", f"{FACTORIES}:{factory}", "--out", str(tmp_path),
                 "--max-time", "0", "--steps", "2", "--peak-memory", "in-process",
                 "--no-progress", "--threads", "1", *args])  # fmt: skip


def test_a_block_recipe_converting_no_layer_exits_2_before_training(tmp_path, capsys):
    (tmp_path / "results.json").write_text("the previous report")
    before = cli_factories.TRAINING_FORWARDS[0]
    code = _compare(tmp_path, "odd_dims", "--recipes", "fp32,mxfp8")
    err = capsys.readouterr().err
    assert code == 2, err
    assert cli_factories.TRAINING_FORWARDS[0] == before  # no training step ran
    assert (tmp_path / "results.json").read_text() == "the previous report"
    assert not (tmp_path / "report.html").exists()
    [line] = [line for line in unwrap(err) if line.strip()]
    assert line.startswith("amped: error: Recipe mxfp8 converts no layer"), line
    assert "--module-filter" in line
    for layer in ("0: dims not multiples of 32", "2: dims not multiples of 32",
                  "4: the output head"):  # fmt: skip
        assert layer in line, line


def test_a_chosen_layer_the_format_cannot_run_exits_2_naming_it(tmp_path, capsys):
    code = _compare(tmp_path, "square_mlp", "--recipes", "mxfp8", "--module-filter", "0,1")
    err = " ".join(unwrap(capsys.readouterr().err))
    assert code == 2, err
    assert "cannot convert layers that --module-filter '0,1' chose" in err
    assert "0: mxfp8 scales blocks of 32" in err  # 8 inputs; layer 1 (64 x 64) converts
    assert not (tmp_path / "results.json").exists()


@pytest.mark.parametrize(
    ("args", "converted", "kept_out"),
    [
        pytest.param(
            (),
            ["1", "3"],
            {"0": "dims not multiples of 32", "4": "the output head (the last Linear/Conv1D)"},
            id="default",
        ),
        # (each case trains two recipes: names-and-exclude covers both flags in the fast
        # subset, these two the full suite)
        pytest.param(
            ("--exclude", "3"), ["1"], {"3": "excluded"}, id="exclude", marks=pytest.mark.slow
        ),
        pytest.param(
            ("--module-filter", r"[1-3]"),
            ["1", "3"],
            {"0": "not chosen by the module filter"},
            id="regex",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ("--module-filter", "3,1", "--exclude", "1"),
            ["3"],
            {"1": "excluded"},
            id="names-and-exclude",
        ),
    ],
)
def test_module_filter_and_exclude_choose_the_converted_layers(
    tmp_path, capsys, args, converted, kept_out
):
    code = _compare(tmp_path, "square_mlp", "--recipes", "fp32,mxfp8", *args)
    assert code == 0, capsys.readouterr().err
    results = json.loads((tmp_path / "results.json").read_text())
    assert validate(results) == []
    conversion = results["conversion"]["mxfp8"]
    assert conversion["converted"] == converted
    assert kept_out.items() <= conversion["kept_out"].items(), conversion
    assert [r["steps_done"] for r in results["recipes"]] == [2, 2]


@pytest.mark.slow
def test_the_filter_reaches_the_trained_model(tmp_path, capsys):
    # Excluding every convertible layer leaves mxfp8 training as bf16-mixed does: the
    # same losses, bit for bit; converting them does not.
    def losses(*args: str) -> dict[str, list[float]]:
        out = tmp_path / "-".join(args or ("default",))
        code = _compare(out, "square_mlp", "--recipes", "bf16-mixed,mxfp8", *args)
        assert code == 0, capsys.readouterr().err
        results = json.loads((out / "results.json").read_text())
        return {r["name"]: r["losses"] for r in results["recipes"]}

    converted = losses()
    assert converted["mxfp8"] != converted["bf16-mixed"]
    # --module-filter 1 --exclude 3 keeps 3 out; 1 alone still converts
    one = losses("--module-filter", "1")
    assert one["mxfp8"] not in (converted["mxfp8"], one["bf16-mixed"])
