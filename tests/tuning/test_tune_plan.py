"""PrecisionPlan and prepare(model, optimizer, plan): round trips, exact reproduction of
the hand-written module-filter setup, and the errors (docs/tune.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import amped
from amped.lowp import Float8Linear
from amped.lowp.mx.block_linear import BlockLinear
from amped.recipes import PrecisionPlan


def _mlp(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128),
        torch.nn.GELU(),
        torch.nn.Linear(128, 64),
        torch.nn.GELU(),
        torch.nn.Linear(64, 32),
    )


def _train(setup: amped.TrainSetup, steps: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(16, 64, generator=g), torch.randn(16, 32, generator=g)
        with setup.autocast():
            loss = torch.nn.functional.mse_loss(setup.model(x).float(), y)
        setup.backward(loss)
        setup.step()
        setup.zero_grad()
        losses.append(loss.detach())
    return losses


def test_plan_round_trips_through_dict_and_file(tmp_path: Path) -> None:
    plan = PrecisionPlan("bf16-mixed", {"0": "fp8-rowwise", "2": "bf16", "4": "mxfp8"})
    assert PrecisionPlan.from_dict(plan.to_dict()) == plan
    path = plan.save(tmp_path / "tuned.json")
    assert PrecisionPlan.load(path) == plan
    assert json.loads(path.read_text())["schema"] == "amped.tune/1"
    assert list(PrecisionPlan.load(path).layers) == ["0", "2", "4"]  # order kept
    assert plan.lowered() == {"0": "fp8-rowwise", "4": "mxfp8"}


@pytest.mark.parametrize(
    ("fmt", "layer_class"),
    [("fp8-rowwise", Float8Linear), ("fp8-tensorwise", Float8Linear), ("mxfp8", BlockLinear)],
    ids=["fp8-rowwise", "fp8-tensorwise", "mxfp8"],
)
def test_single_format_plan_trains_bitwise_as_the_module_filter(fmt, layer_class) -> None:
    names = {"0", "2"}
    by_filter = _mlp()
    setup_filter = amped.prepare(
        by_filter,
        torch.optim.AdamW(by_filter.parameters(), lr=1e-2),
        fmt,
        module_filter=lambda m, name: name in names,
    )
    by_plan = _mlp()
    plan = PrecisionPlan("bf16-mixed", {"0": fmt, "2": fmt, "4": "bf16"})
    setup_plan = amped.prepare(by_plan, torch.optim.AdamW(by_plan.parameters(), lr=1e-2), plan)
    assert isinstance(by_plan[0], layer_class) and isinstance(by_plan[2], layer_class)
    assert type(by_plan[4]) is torch.nn.Linear
    for a, b in zip(_train(setup_filter), _train(setup_plan), strict=True):
        assert torch.equal(a, b)
    for (name, p), q in zip(by_filter.named_parameters(), by_plan.parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize(
    "base",
    [pytest.param("bf16-master", marks=pytest.mark.slow), "bf16-pure"],  # master: ~10 s
)
def test_a_plan_over_another_base_trains_bitwise_as_the_module_filter(base: str) -> None:
    by_filter = _mlp()
    setup_filter = amped.prepare(
        by_filter,
        torch.optim.AdamW(by_filter.parameters(), lr=1e-2),
        "fp8-rowwise",
        base=base,
        module_filter=lambda m, name: name == "2",
    )
    by_plan = _mlp()
    plan = PrecisionPlan(base, {"2": "fp8-rowwise"})
    setup_plan = amped.prepare(by_plan, torch.optim.AdamW(by_plan.parameters(), lr=1e-2), plan)
    assert type(setup_plan.optimizer) is type(setup_filter.optimizer)
    for a, b in zip(_train(setup_filter), _train(setup_plan), strict=True):
        assert torch.equal(a, b)
    filtered, planned = setup_filter.fp32_state_dict(), setup_plan.fp32_state_dict()
    assert filtered.keys() == planned.keys()
    assert all(torch.equal(filtered[k], planned[k]) for k in filtered)


def test_mixed_plan_converts_each_layer_to_its_format(tmp_path: Path) -> None:
    model = _mlp()
    plan = PrecisionPlan("bf16-mixed", {"0": "mxfp8", "2": "fp8-rowwise", "4": "bf16"})
    setup = amped.prepare(model, torch.optim.AdamW(model.parameters()), plan)
    assert isinstance(model[0], BlockLinear) and isinstance(model[2], Float8Linear)
    assert type(model[4]) is torch.nn.Linear
    assert setup.low_precision_layers is not None and setup.low_precision_layers.names() == [
        "0",
        "2",
    ]
    assert setup.recipe.name == f"plan-{plan.digest()}"
    assert all(torch.isfinite(loss) for loss in _train(setup))


@pytest.mark.parametrize("as_path", [True, False], ids=["pathlib", "str"])
def test_prepare_reads_a_tuned_json_path(tmp_path: Path, as_path: bool) -> None:
    path = PrecisionPlan("bf16-mixed", {"2": "fp8-rowwise"}).save(tmp_path / "tuned.json")
    model = _mlp()
    amped.prepare(model, torch.optim.SGD(model.parameters()), path if as_path else str(path))
    assert isinstance(model[2], Float8Linear) and type(model[0]) is torch.nn.Linear


def test_a_checkpoint_loads_only_into_the_same_plan() -> None:
    first, second = _mlp(), _mlp()
    plan_a = PrecisionPlan("bf16-mixed", {"0": "fp8-rowwise"})
    plan_b = PrecisionPlan("bf16-mixed", {"2": "fp8-rowwise"})
    state = amped.prepare(first, torch.optim.SGD(first.parameters()), plan_a).state_dict()
    other = amped.prepare(second, torch.optim.SGD(second.parameters()), plan_b)
    with pytest.raises(ValueError, match="plan-"):
        other.load_state_dict(state)


@pytest.mark.parametrize(
    ("layers", "match"),
    [
        ({"9": "fp8-rowwise"}, "has no module of that name"),
        ({"1": "fp8-rowwise"}, "GELU, not an nn.Linear"),
        ({"4": "mxfp8"}, "not multiples of 32"),
    ],
    ids=["missing-layer", "not-a-linear", "dims-not-multiples"],
)
def test_prepare_refuses_a_plan_the_model_cannot_run(layers, match) -> None:
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
        torch.nn.Linear(64, 16),
    )  # fmt: skip
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=match):
        amped.prepare(
            model, torch.optim.SGD(model.parameters()), PrecisionPlan("bf16-mixed", layers)
        )
    assert all(type(m) is not Float8Linear for m in model.modules())  # nothing changed
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_prepare_refuses_a_layer_a_policy_rule_keeps_out() -> None:
    model = _mlp()
    policy = amped.Policy.preset("torch", "cpu").with_module("2", "fp32")
    plan = PrecisionPlan("bf16-mixed", {"2": "fp8-rowwise"})
    with pytest.raises(ValueError, match="module rule"):
        amped.prepare(model, torch.optim.SGD(model.parameters()), plan, policy=policy)


@pytest.mark.parametrize(
    ("base", "layers", "match"),
    [
        ("bf16-mixed", {"0": "fp8-delayed"}, "A plan format is one of"),
        ("bf16-mixed", {"0": "int4"}, "A plan format is one of"),
        ("fp16-mixed", {"0": "bf16"}, "A plan's base is one of"),
    ],
    ids=["delayed", "unknown", "fp16-base"],
)
def test_plan_refuses_unknown_formats_and_bases(base, layers, match) -> None:
    with pytest.raises(ValueError, match=match):
        PrecisionPlan(base, layers)


def test_prepare_refuses_fp8_arguments_with_a_plan() -> None:
    model = _mlp()
    with pytest.raises(ValueError, match="carries its own base"):
        amped.prepare(
            model,
            torch.optim.SGD(model.parameters()),
            PrecisionPlan("bf16-mixed", {"0": "fp8-rowwise"}),
            base="bf16-master",
        )


@pytest.mark.parametrize(
    ("content", "match"),
    [('{"schema": "other/1", "layers": {}}', "schema"), ("not json", "not JSON")],
    ids=["wrong-schema", "not-json"],
)
def test_load_refuses_other_files(tmp_path: Path, content: str, match: str) -> None:
    path = tmp_path / "tuned.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        PrecisionPlan.load(path)
    with pytest.raises(ValueError, match="Could not read"):
        PrecisionPlan.load(tmp_path / "missing.json")


def _file(layers: str = "{}", base: str = '"bf16-mixed"') -> str:
    """A tuned.json's text with ``base`` and ``layers`` written as given (raw JSON)."""
    return '{"schema": "amped.tune/1", "base": ' + base + ', "layers": ' + layers + "}"


_DEEP = 100_000


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (_file('{"0": NaN}'), "layer '0' has no format"),
        (_file('{"0": Infinity}'), "format=inf"),
        (_file('{"0": "inf"}'), "format=inf"),
        (_file('{"0": 8}'), "format=8 .of type int"),
        (_file('{"0": null}'), "format=None"),
        (_file('{"0": ["mxfp8"]}'), "of type list"),
        (_file('["0"]'), '"layers" is a JSON object'),
        (_file("null"), '"layers" is a JSON object'),
        (_file(base="NaN"), '"base" is a recipe name'),
        (_file(base='["bf16-mixed"]'), '"base" is a recipe name'),
        (_file("[" * _DEEP + "]" * _DEEP), "nests its JSON too deeply"),
        ('{"x": ' + '{"a": ' * _DEEP + "1" + "}" * _DEEP + "}", "nests its JSON too deeply"),
        (_file('{"0": ' + "9" * 5000 + "}"), "not a JSON amped can read"),
    ],
    ids=["nan", "infinity", "inf-string", "number", "null", "list", "layers-list",
         "layers-null", "base-nan", "base-list", "deep-array", "deep-object", "huge-int"],
)  # fmt: skip
def test_load_refuses_a_hostile_file_with_a_value_error(
    tmp_path: Path, content: str, match: str
) -> None:
    # Whatever the file holds, loading it is a ValueError saying what was wrong and
    # naming the file (before: AttributeError, TypeError or RecursionError).
    path = tmp_path / "tuned.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match) as raised:
        PrecisionPlan.load(path)
    assert str(path) in str(raised.value)
    assert len(str(raised.value)) < 600  # a huge value is not echoed whole


def test_load_refuses_bytes_that_are_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "tuned.json"
    path.write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match="not UTF-8 text") as raised:
        PrecisionPlan.load(path)
    assert str(path) in str(raised.value)


def test_a_plan_built_in_python_refuses_a_format_that_is_not_a_string() -> None:
    with pytest.raises(TypeError, match=r"A plan's formats are strings.*layer '0'"):
        PrecisionPlan("bf16-mixed", {"0": float("nan")})
