"""Numbers in `amped compare` a reader can trust: step-time spread, the busy-machine
warning, no "fastest" claim the spread does not allow, peak memory whose ordering
follows the state each recipe holds, and tables that fit 80 columns."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from repo_paths import HELPERS

pytest.importorskip("rich")
pytest.importorskip("matplotlib")

from rich.console import Console

from amped.cli.compare.table import print_summary
from amped.cli.main import main
from amped.comparison.findings import findings, warnings
from amped.comparison.summary import loss_decimals
from amped.comparison.timing import CpuLoad, clear_winner, cores_available, ratio_range, step_stats

# Timing-sensitive: under `pytest -n 2 --dist loadgroup` one worker runs every test of
# the "timing" group, one after another, so no two of them share the cores.
pytestmark = pytest.mark.xdist_group("timing")

FACTORIES = HELPERS / "cli_factories.py"


def _timing(median: float, q1: float, q3: float) -> dict:
    return {"repeats": 9, "median_s": median, "q1_s": q1, "q3_s": q3, "min_s": q1, "max_s": q3}


def test_step_stats_leave_out_warm_up_and_interpolate_quartiles():
    stats = step_stats([9.0, 1.0, 2.0, 3.0, 4.0, 5.0])  # 9.0: the warm-up step
    assert stats is not None
    assert (stats.repeats, stats.median, stats.q1, stats.q3) == (5, 3.0, 2.0, 4.0)
    assert (stats.low, stats.high) == (1.0, 5.0)
    assert step_stats([]) is None
    assert step_stats([0.5]).median == 0.5  # a single step is all there is


def test_ratio_range_is_what_both_iqrs_allow():
    fast, base = _timing(1.0, 0.9, 1.2), _timing(2.0, 1.8, 2.4)
    assert ratio_range(fast, base) == pytest.approx((1.8 / 1.2, 2.4 / 0.9))


@pytest.mark.parametrize(
    ("b_quartiles", "winner"),
    [((1.3, 1.5), "a"), ((1.1, 1.5), None)],  # a's q3 is 1.2: clear of 1.3, not of 1.1
    ids=["separated", "overlapping"],
)
def test_a_winner_only_when_its_iqr_is_clear_of_every_other(b_quartiles, winner):
    timings = {"a": _timing(1.0, 0.9, 1.2), "b": _timing(1.4, *b_quartiles)}
    assert clear_winner(timings) == winner


def _results(b_quartiles: tuple[float, float], busy: bool = False) -> dict:
    def recipe(name: str, timing: dict, ratio: float) -> dict:
        return {
            "name": name, "samples_per_s": 8 / timing["median_s"], "timing": timing,
            "throughput_vs_baseline": ratio, "throughput_vs_baseline_range": [ratio, ratio],
            "memory": None, "train_loss_at_common_step": None, "loss_scaling": False,
            "error": None, "skipped_steps": 0, "final_loss_scale": None,
        }  # fmt: skip

    return {
        "baseline": "fp32",
        "partial": False,
        "plan": None,
        "common_step": 10,
        "environment": {"device": "cpu", "cpu": "x", "native_low_precision": {}},
        "machine": {
            "cores": 2,
            "threads": 1,
            "other_processes_cores": 1.9,
            "load_average_1min": 4.0,
            "busy": busy,
        },
        "identical_losses": [["bf16-mixed", "bf16-master"]],
        "recipes": [
            recipe("fp32", _timing(1.4, *b_quartiles), 1.0),
            recipe("bf16-mixed", _timing(1.0, 0.95, 1.15), 1.4),
        ],
    }


def test_fastest_headline_appears_only_when_the_spread_allows_it():
    clear = findings(_results((1.3, 1.5)))
    assert any(line.startswith("Fastest: bf16-mixed, 1.40×") for line in clear), clear
    overlapping = findings(_results((1.1, 1.5)))
    assert not any("Fastest" in line for line in overlapping), overlapping
    assert any(line.startswith("No recipe is clearly fastest") for line in overlapping)


def test_fastest_headline_without_fp32_in_the_run_names_no_ratio():
    results = _results((1.3, 1.5))
    results["recipes"][0]["name"] = "fp8-rowwise"  # no fp32 among the recipes run
    for recipe in results["recipes"]:
        recipe["throughput_vs_baseline"] = recipe["throughput_vs_baseline_range"] = None
    lines = findings(results)
    assert "Fastest: bf16-mixed; its step-time IQR is clear of every other recipe's." in lines


def test_findings_name_the_recipes_whose_curves_coincide():
    lines = findings(_results((1.3, 1.5)))
    assert "Identical train loss at every step (their curves coincide): " \
        "bf16-mixed = bf16-master." in lines  # fmt: skip


def test_busy_and_wide_spread_warnings():
    assert warnings(_results((1.3, 1.5))) == []
    busy = warnings(_results((1.3, 1.5), busy=True))
    assert len(busy) == 1 and busy[0].startswith("Busy machine: other processes used 1.9")
    wide = warnings(_results((0.5, 2.5)))  # IQR 2.0 s around a 1.4 s median
    assert len(wide) == 1 and wide[0].startswith("Wide spread")


def test_cpu_load_sees_other_processes_and_not_its_own_work():
    spinners = [_spin() for _ in range(cores_available() + 1)]
    try:
        load = CpuLoad(threads=1).start()
        _burn(1.0)  # this process's own work does not count as "other processes"
        record = load.stop()
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert record["busy"] is True, record
    assert record["other_processes_cores"] > cores_available() - 1


def _spin() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def _burn(seconds: float) -> None:
    import time

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@pytest.mark.slow
def test_compare_on_a_busy_machine_warns_and_shows_the_spread(tmp_path, capsys, monkeypatch):
    # In process (stdout captured, as piped: 80 columns): what is shown is the run's.
    monkeypatch.delenv("COLUMNS", raising=False)
    spinners = [_spin() for _ in range(cores_available() + 2)]
    try:
        code = main(["compare", "--model", f"{FACTORIES}:good", "--recipes", "fp32,bf16",
                     "--steps", "40", "--max-time", "0", "--threads", "1", "--peak-memory",
                     "in-process", "--no-progress", "--out", str(tmp_path)])  # fmt: skip
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert code == 0
    out = capsys.readouterr().out
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["machine"]["busy"] is True
    assert "warning: Busy machine: other processes used" in " ".join(out.split())
    assert "IQR" in out and "range" in out
    for recipe in results["recipes"]:
        low, high = recipe["samples_per_s_iqr"]
        assert low <= recipe["samples_per_s"] <= high
        assert f"{low:,.0f}–{high:,.0f}" in out  # the spread is printed next to the speed
    timings = {r["name"]: r["timing"] for r in results["recipes"]}
    headline = [line for line in out.splitlines() if "Fastest:" in line]
    assert bool(headline) == (clear_winner(timings) not in (None, "fp32"))
    assert all(len(line) <= 80 for line in out.splitlines()), out  # piped: 80 columns


@pytest.mark.slow
def test_own_process_peak_follows_the_state_each_recipe_holds(tmp_path, capsys):
    # Plain SGD: no optimizer state and no step temporaries, so the recipes differ in
    # the state they hold alone (see cli_factories.wide_mlp_sgd). bf16-master's fused
    # step reads the bfloat16 gradients directly (no float32 master gradients): lowered
    # weights and gradients (2 + 2) and float32 masters (4) against fp32's weights and
    # gradients (4 + 4), plus the fused step's chunk rows: 0 to 4 bytes/param more.
    args = ["compare", "--model", f"{FACTORIES}:wide_mlp_sgd", "--recipes",
            "fp32,bf16-master", "--steps", "2", "--max-time", "0", "--threads", "1",
            "--json", "--no-progress", "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    results = json.loads(capsys.readouterr().out)
    fp32, master = (r["memory"] for r in results["recipes"])
    assert fp32["peak_kind"] == master["peak_kind"] == "own_process_peak_rss"
    params = fp32["param_count"]
    extra = (master["peak_bytes"] - fp32["peak_bytes"]) / params
    # Measured 1.0 bytes/param (1.7 in a script with the same stand-in compile first; the
    # unfused step measured 3.5 to 4.1, with its float32 master gradients). The probe
    # compiles the step on a stand-in before reading the baseline, so Inductor's own
    # memory is not counted; the band leaves room for allocator rounding.
    assert -1.0 < extra < 4.5, (fp32, master)
    assert fp32["peak_bytes"] > 4 * params  # at least the gradients


@pytest.fixture(scope="module")
def every_recipe(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("every")
    args = ["compare", "--model", f"{FACTORIES}:good", "--steps", "3", "--max-time", "0",
            "--threads", "1", "--peak-memory", "in-process", "--no-progress", "--out",
            str(out), "--json"]  # fmt: skip
    stdout = io.StringIO()
    from contextlib import redirect_stdout

    with redirect_stdout(stdout):
        assert main(args) == 0
    return json.loads(stdout.getvalue())


@pytest.mark.slow
def test_tables_fit_80_columns_with_one_line_per_recipe(every_recipe):
    console = Console(width=80, record=True, file=io.StringIO(), color_system=None)
    print_summary(every_recipe, (), console)
    lines = console.export_text().splitlines()
    assert all(len(line) <= 80 for line in lines)
    for recipe in every_recipe["recipes"]:
        rows = [line for line in lines if line.startswith(f" {recipe['name']} ")]
        assert len(rows) == 2, (recipe["name"], rows)  # one row in each table, unwrapped
        speed = f"{recipe['samples_per_s']:,.0f}"
        assert speed in rows[0]
        assert recipe["throughput_vs_baseline"] is None  # 2 timed steps: no ratio
        digits = loss_decimals([r["train_loss_at_common_step"] for r in every_recipe["recipes"]])
        assert f"{recipe['train_loss_at_common_step']:.{digits}f}" in rows[1]
