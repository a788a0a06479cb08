"""`amped compare` in process on a tiny task: planning, recipes, data, progress, report."""

from __future__ import annotations

import io
import json

import pytest
import torch
from repo_paths import HELPERS

from amped.cli.main import main

pytest.importorskip("rich")
pytest.importorskip("matplotlib")

from cli_fault_helpers import unwrap
from results_schema import validate
from rich.console import Console

from amped.cli.compare.progress import LineProgress, RichProgress
from amped.cli.compare.report import render_html
from amped.comparison.compare import run_comparison
from amped.comparison.results import to_dict
from amped.comparison.run import CompareConfig
from amped.comparison.summary import findings, rows
from amped.recipes.registry import resolve_recipe
from amped.tasks.factory import load_factory

FACTORIES = HELPERS / "cli_factories.py"


def _json_run(capsys, tmp_path, *args: str) -> dict:
    # In process: the own-process peak-memory probe is tested in test_cli_timing.py.
    base = [
        "compare",
        "--out",
        str(tmp_path),
        "--json",
        "--no-progress",
        "--peak-memory",
        "in-process",
    ]
    code = main([*base, *args])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    results = json.loads(captured.out)
    assert validate(results) == []
    return results


@pytest.mark.slow
def test_recipes_take_aliases_run_fp32_first_and_drop_duplicates(capsys, tmp_path):
    args = ("--model", f"{FACTORIES}:good", "--recipes", "O1,bf16,fp32,amp", "--steps", "3")
    results = _json_run(capsys, tmp_path, *args)
    assert [r["name"] for r in results["recipes"]] == ["fp32", "fp16-mixed", "bf16-mixed"]
    assert results["baseline"] == "fp32"
    # 2 timed steps each: too few to compare speed, so no ratio to fp32 at all.
    assert not results["speed"]["comparable"]
    assert [r["throughput_vs_baseline"] for r in results["recipes"]] == [None] * 3


@pytest.mark.slow
def test_budget_plans_one_step_count_for_every_recipe(capsys, tmp_path):
    args = ("--model", f"{FACTORIES}:good", "--recipes", "fp32,bf16", "--steps", "40")
    results = _json_run(capsys, tmp_path, *args, "--max-time", "0.001")
    plan = results["plan"]
    assert plan["shortened"] and plan["steps"] == 1  # nothing fits 1 ms: one step each
    assert set(plan["step_s"]) == {"fp32", "bf16-mixed"}
    assert [r["steps_done"] for r in results["recipes"]] == [1, 1]
    assert results["common_step"] == 1
    assert any("to fit --max-time" in line for line in findings(results))
    assert results["speed"]["comparable"] is False
    unlimited = _json_run(capsys, tmp_path, *args, "--max-time", "0")
    assert unlimited["plan"] is None
    assert [r["steps_done"] for r in unlimited["recipes"]] == [40, 40]
    assert [r["steps"] for r in rows(unlimited)] == ["40", "40"]


def test_finite_data_stops_the_recipe_and_says_why(capsys, tmp_path):
    args = ("--model", f"{FACTORIES}:finite", "--recipes", "fp32", "--steps", "8")
    (recipe,) = _json_run(capsys, tmp_path, *args, "--max-time", "0")["recipes"]
    assert (recipe["status"], recipe["stop_reason"], recipe["steps_done"]) == (
        "stopped",
        "data ran out",
        5,
    )
    assert recipe["notes"] == ["data ran out after 5 of 8 steps"]


def test_task_extras_are_used_and_reported(capsys, tmp_path):
    args = ("--model", f"{FACTORIES}:with_task", "--recipes", "fp32,fp16", "--steps", "4")
    results = _json_run(capsys, tmp_path, *args, "--max-time", "0")
    assert results["task"]["name"] == "tiny-classifier"
    fp32, fp16 = results["recipes"]
    assert set(fp32["eval"]) == {"accuracy"}
    # SGD without momentum keeps no optimizer state: 4 + 4 bytes per parameter.
    assert fp32["memory"]["bytes_per_param"] == 8.0
    assert fp16["loss_scales"] == [65536.0] * 4 and fp16["skipped_steps"] == 0


def _comparison(recipes: str, steps: int, observer):
    config = CompareConfig(
        factory=load_factory(f"{FACTORIES}:good"),
        recipes=tuple(resolve_recipe(r) for r in recipes.split(",")),
        steps=steps,
        batch_size=None,
        device=torch.device("cpu"),
        seed=0,
        max_time=None,
    )
    with observer:
        return run_comparison(config, observer)


def test_rich_progress_shows_a_bar_per_recipe_with_loss_and_throughput():
    stream = io.StringIO()
    console = Console(file=stream, force_terminal=True, width=140)
    _comparison("fp32,bf16", 3, RichProgress(["fp32", "bf16-mixed"], 3, console))
    text = stream.getvalue()
    for expected in ("fp32", "bf16-mixed", "3/3", "loss", "samples/s", "complete"):
        assert expected in text


def test_line_progress_reports_each_recipe_with_the_results_figures():
    stream = io.StringIO()
    comparison = _comparison("fp32", 2, LineProgress(stream))
    lines = unwrap(stream.getvalue())
    assert lines[0] == "fp32: running 2 steps"
    (recipe,) = to_dict(comparison, {}, ["amped"])["recipes"]
    loss, speed = recipe["final_train_loss"], recipe["samples_per_s"]
    assert lines[1] == (
        f"fp32: complete after 2 steps, final train loss {loss:.3f} (mean of the last 2 "
        f"steps), {speed:,.0f} samples/s"
    )


def test_a_single_step_has_no_throughput_or_iqr_and_the_peaks_say_where_measured():
    # One step is warm-up only: no timed step, so no samples/s and no IQR anywhere.
    stream = io.StringIO()
    comparison = _comparison("fp32", 1, LineProgress(stream))
    (recipe,) = to_dict(comparison, {}, ["amped"])["recipes"]
    assert recipe["samples_per_s"] is None and recipe["samples_per_s_iqr"] is None
    assert "samples/s" not in stream.getvalue()
    # isolate_memory was off: the peaks were measured in this process, and say so
    assert to_dict(comparison, {}, ["amped"])["config"]["peak_memory"] == "in-process"


def test_a_long_first_compile_is_announced_with_its_expected_time_before_it_starts():
    from amped.comparison.run import RecipeRun
    from amped.comparison.warmup import FIRST_COMPILE_S, compiled_part

    stream = io.StringIO()
    recipe = resolve_recipe("bf16-pure-8bit")
    what = compiled_part(recipe)
    assert what == "the fused 8-bit AdamW step" and FIRST_COMPILE_S[what][0] > 30
    LineProgress(stream).warming_up(RecipeRun(recipe, 2, 2), what)
    assert unwrap(stream.getvalue()) == [
        "bf16-pure-8bit: compiling the fused 8-bit AdamW step (about 3 min the first time "
        "on a busy 2-core CPU, 51 s once cached; outside --max-time)"
    ]


def test_report_of_partial_results_says_so():
    comparison = _comparison("fp32,bf16", 2, LineProgress(io.StringIO()))
    comparison.partial = True
    comparison.runs[1].status = "not_run"
    results = to_dict(comparison, {"python": "3", "torch": "t", "amped": "a", "device": "cpu",
                                   "cpu": "c"}, ["amped", "compare"])  # fmt: skip
    assert validate(results) == []
    page = render_html(results)
    assert "Partial results" in page
    assert "not run (the comparison was interrupted)" in page
    assert page.count("data:image/png;base64,") == 3  # no loss-scale plot without fp16
    assert "nothing to plot" in page


def test_recipes_take_dtype_names_as_torch_spells_them():
    from amped.comparison.setup import parse_recipes

    chosen = parse_recipes("bfloat16,torch.float16,float32,half,bf16")
    assert [r.name for r in chosen] == ["bf16-mixed", "fp16-mixed", "fp32"]


def test_the_environment_block_says_what_the_emulated_gemms_multiply_in():
    from amped.comparison.environment import describe
    from amped.lowp.float8.emulated_gemm import set_emulated_gemm

    previous = set_emulated_gemm("float32")
    try:
        env = describe(torch.device("cpu"))
    finally:
        set_emulated_gemm(previous)
    assert env["emulated_gemm"] == {
        "dtype": "float32",
        "chosen_by": "set",
        "reason": "set_emulated_gemm('float32')",
    }
    results = to_dict(_comparison("fp32", 2, LineProgress(io.StringIO())), env, ["amped"])
    assert validate(results) == []
    page = render_html(results)
    assert "<dt>emulated FP8/block GEMMs in</dt><dd>float32 (set: set_emulated_gemm(" in page
