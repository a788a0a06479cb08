"""``amped.compare`` from a script: the comparison of ``amped compare`` as a returned
value, the document ``results.json`` holds, field for field."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import cli_factories  # the CLI tests' factories: one contract for both
import pytest
import torch
from results_schema import validate

import amped
from amped.comparison import CompareResult


def test_compare_returns_what_results_json_holds(tmp_path):
    threads = torch.get_num_threads()
    result = amped.compare(
        "fp32,bf16", model=cli_factories.with_task, steps=3, max_time=60.0, threads=1,
        peak_memory="in-process",
    )  # fmt: skip
    assert torch.get_num_threads() == threads  # restored
    assert isinstance(result, CompareResult)
    written = json.loads(result.save(tmp_path / "results.json").read_text())
    assert validate(written) == []
    assert [f.name for f in dataclasses.fields(result)] == list(written)
    for name, value in written.items():
        assert getattr(result, name) == value, name
    assert dataclasses.asdict(result) == result.to_dict() == written
    assert result.to_json() == (tmp_path / "results.json").read_text()
    assert [r["name"] for r in result.recipes] == ["fp32", "bf16-mixed"]
    assert [r["steps_done"] for r in result.recipes] == [3, 3]
    assert {r["status"] for r in result.recipes} == {"complete"}
    assert result.task is not None and result.task["name"] == "tiny-classifier"
    assert result.recipes[0]["eval"] is not None  # the Task's held-out metrics


def test_the_recorded_command_repeats_the_comparison():
    from amped.cli.arguments import build_parser

    result = amped.compare(
        ["bf16", "fp32"], model=cli_factories.good, steps=2, max_time=None, batch_size=4,
        peak_memory="in-process",
    )  # fmt: skip
    args = build_parser().parse_args(result.command[1:])
    assert result.command[:2] == ["amped", "compare"]
    assert (args.recipes, args.steps, args.batch_size, args.max_time) == (
        "bf16-mixed,fp32", 2, 4, 0.0,
    )  # fmt: skip
    assert args.model == f"{cli_factories.__name__}:good" == result.config["task"]
    assert args.peak_memory == "in-process" == result.config["peak_memory"]


def test_peak_memory_follows_what_the_factory_allows():
    def nested(seed: int = 0):
        return cli_factories.good(batch_size=4, seed=seed)

    result = amped.compare("fp32", model=nested, steps=1, max_time=None)
    assert result.config["peak_memory"] == "in-process"  # no other process can load it
    with pytest.raises(ValueError, match="peak_memory='in-process'"):
        amped.compare("fp32", model=nested, steps=1, peak_memory="own-process")


def test_a_factory_may_return_an_object_with_the_three_attributes():
    """The contract amped.tune always took holds for compare too: one contract."""

    def factory(seed: int = 0):
        model, batches, loss_fn = cli_factories.good(batch_size=4, seed=seed)
        sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731
        return SimpleNamespace(model=model, batches=batches, loss_fn=loss_fn, optimizer=sgd)

    result = amped.compare("fp32", model=factory, steps=2, max_time=None)
    assert result.recipes[0]["status"] == "complete"
    assert result.recipes[0]["memory"]["optimizer_state_bytes"] == 0  # SGD: no state


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"model": torch.nn.Linear(8, 2)}, TypeError, "not a model"),
        ({"steps": 0}, ValueError, "steps is an int >= 1"),
        ({"steps": 2.5}, TypeError, "steps is an int"),
        ({"max_time": -1}, ValueError, "max_time"),
        ({"peak_memory": "shared"}, ValueError, "peak_memory is one of"),
        ({"recipes": "fp64"}, ValueError, "fp64"),
        ({"model": "no_such_module:build"}, ValueError, "No module named"),
        ({"model": cli_factories.returns_tensor}, TypeError, "must return"),
    ],
    ids=["model", "zero-steps", "float-steps", "negative-time", "peak", "recipe", "spec",
         "contract"],
)  # fmt: skip
def test_bad_arguments_say_what_is_allowed(kwargs, error, match):
    kwargs = {"model": cli_factories.good, "steps": 1, **kwargs}
    with pytest.raises(error, match=match):
        amped.compare(**kwargs)


@pytest.mark.slow
def test_the_docstring_example_runs():
    """``amped.compare``'s example: the built-in task, two recipes, two steps."""
    import doctest

    from amped.comparison import api

    result = doctest.testmod(api, optionflags=doctest.ELLIPSIS)
    assert result.attempted and not result.failed


@pytest.mark.slow
def test_an_attention_config_runs_in_every_recipe_on_the_tiny_gpt(tmp_path):
    # the built-in tiny GPT's attention is nn.MultiheadAttention (its encoder layers)
    result = amped.compare("fp32,bf16", steps=2, max_time=None, threads=1,
                           peak_memory="in-process", attention="fp8-all-but-ds")  # fmt: skip
    assert validate(json.loads(result.save(tmp_path / "results.json").read_text())) == []
    assert result.config["attention"] == "fp8-all-but-ds"
    assert result.attention == {"config": "s:e4m3/head,o:e4m3/head,dv:e4m3/head,grad=e5m2,"
                                "dp:e4m3/head,grad=e5m2", "not_converted": []}  # fmt: skip
    assert {r["status"] for r in result.recipes} == {"complete"}
    assert result.command[-2:] == ["--attention", "fp8-all-but-ds"]  # repeats it
    from amped.comparison.summary import footnotes

    assert any(
        line.startswith("attention: s:e4m3/head,") and "every module converted" in line
        for line in footnotes(result.to_dict())
    )


def test_an_attention_config_lists_what_it_could_not_convert():
    from amped.comparison.setup import make_config

    threads = torch.get_num_threads()
    kwargs = dict(recipes="fp32", model=cli_factories.good, steps=1, batch_size=None,
                  device="cpu", seed=0, max_time=None, threads=threads,
                  isolate_memory=False)  # fmt: skip
    config = make_config(**kwargs, attention="fp8")  # checked before any training
    ((name, why),) = config.attention_conversion.not_converted
    assert name == "" and "no nn.MultiheadAttention" in why
    with pytest.raises(ValueError, match="--attention: config is an AttentionConfig or one of"):
        make_config(**kwargs, attention="fp9")
