"""The fp8-* recipes through ``amped.prepare``: base recipes, which layers convert
(module filter, policy module rules), memory_report, checkpoints (bitwise resume,
delayed-scaling history included) and the errors for what they cannot do."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from recipes_helpers import roundtrip, setup_tensors, train

import amped
from amped.lowp import Float8Linear
from amped.recipes.registry import OPT_IN_RECIPES, RECIPES, resolve_recipe

FP8 = ["fp8-tensorwise", "fp8-rowwise", "fp8-rowwise-gw-hp", "fp8-delayed"]


class Net(nn.Module):
    """fc1 (64->128) -> norm -> GELU -> fc2 (128->128) -> GELU -> odd (128->40) -> head (40->10)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1, self.norm, self.fc2 = nn.Linear(64, 128), nn.LayerNorm(128), nn.Linear(128, 128)
        self.odd, self.head = nn.Linear(128, 40), nn.Linear(40, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc2(F.gelu(self.norm(self.fc1(x)))))
        return self.head(self.odd(h))


def _data(steps: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g))
        for _ in range(steps)
    ]


def _prepare(recipe, seed=0, opt="adamw", **kw):
    model = Net(seed)
    optim = (
        torch.optim.AdamW(model.parameters(), lr=1e-3)
        if opt == "adamw"
        else torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    )
    return amped.prepare(model, optim, recipe, **kw)


def test_fp8_recipes_are_opt_in():
    blocks = ["mxfp8", "mxfp4", "nvfp4"]
    assert list(OPT_IN_RECIPES) == ["bf16-pure-8bit", *FP8, "fp8-blockwise", *blocks]
    assert not {*FP8, "fp8-blockwise"} & set(RECIPES)  # `amped compare` with no --recipes
    assert resolve_recipe("FP8-TE").name == "fp8-delayed"
    pytest.importorskip("rich")
    from amped.comparison.setup import parse_recipes

    assert [r.name for r in parse_recipes("fp8-rowwise,bf16")] == ["fp8-rowwise", "bf16-mixed"]
    assert parse_recipes("all") == tuple(RECIPES.values())


@pytest.mark.parametrize("base", ["bf16-mixed", "bf16-master", "bf16-pure", "bf16-pure-sr"])
@pytest.mark.parametrize("recipe", FP8)
def test_each_recipe_trains_on_each_base(recipe, base):
    setup = _prepare(recipe, base=base)
    assert setup.recipe.name == recipe
    assert setup.recipe.weights == resolve_recipe(base).weights
    assert setup.low_precision_layers.names() == ["fc1", "fc2"]  # odd dims and the head stay out
    assert isinstance(setup.model.fc1, Float8Linear) and type(setup.model.odd) is nn.Linear
    low = torch.float32 if base == "bf16-mixed" else torch.bfloat16
    assert setup.model.fc2.weight.dtype is low
    batch = _data(1)
    first = train(setup, batch)[-1]
    last = train(setup, batch * 20)[-1]
    assert last < 0.8 * first  # it learns (memorises one batch)


def test_converted_layer_runs_fp8_with_autocast_off_inside():
    """Under the recipe's bfloat16 region the layer casts its input to bfloat16 once and
    nothing inside is re-cast by the policy: the same bits as the layer called on a
    bfloat16 input outside any region."""
    setup = _prepare("fp8-tensorwise")
    x = torch.randn(16, 64)
    with setup.autocast():
        inside = setup.model.fc1(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # torch's own region: the same
        inside_torch = setup.model.fc1(x)
    outside = setup.model.fc1(x.to(torch.bfloat16))
    assert inside.dtype is torch.bfloat16
    assert torch.equal(inside, outside) and torch.equal(inside_torch, outside)


def test_module_filter_and_policy_module_rules_choose_the_layers():
    setup = _prepare("fp8-rowwise", module_filter=lambda m, name: name != "fc2")
    assert setup.low_precision_layers.names() == [
        "fc1",
        "odd",
        "head",
    ]  # odd dims: the filter's call
    policy = amped.Policy.preset("torch", "cpu").with_module("fc1", "fp32")
    setup = _prepare("fp8-rowwise", policy=policy)
    assert setup.low_precision_layers.names() == ["fc2"]
    in_bf16 = amped.Policy.preset("torch", "cpu").with_module("fc2", "low")
    assert _prepare("fp8-rowwise", policy=in_bf16).low_precision_layers.names() == ["fc1"]
    with pytest.raises(ValueError, match=r"no nn\.Linear or Conv1D layer to convert"):
        _prepare("fp8-rowwise", policy=policy.with_module(nn.Linear, "skip"))


def test_memory_report_counts_delayed_scaling_state():
    tensorwise, delayed = _prepare("fp8-tensorwise"), _prepare("fp8-delayed")
    plain = _prepare("bf16-mixed")
    for setup in (tensorwise, delayed, plain):
        train(setup, _data(1))
    reports = [amped.memory_report(s.model, s.optimizer) for s in (tensorwise, delayed, plain)]
    assert reports[0] == reports[2]  # dynamic scaling holds no state
    # per layer: history 3x16 + scale 3 + maxima 3 float32, one int64 counter
    per_layer = (3 * 16 + 3 + 3) * 4 + 8
    assert reports[1].fp8_state == 2 * per_layer
    assert reports[1].total == reports[2].total + 2 * per_layer
    assert "FP8 amax history" in reports[1].table()


@pytest.mark.parametrize("base", ["bf16-mixed", "bf16-master", "bf16-pure"])
@pytest.mark.parametrize("recipe", FP8)
def test_checkpoint_resume_is_bitwise(recipe, base):
    data = _data(6)
    setup = _prepare(recipe, base=base)
    train(setup, data[:3])
    saved = roundtrip(setup.state_dict())
    if recipe == "fp8-delayed":
        history = saved["model"]["fc1.fp8_amax_history"]
        assert (history[:, :3] > 0).all() and (history[:, 3:] == 0).all()
    train(setup, data[3:])

    fresh = _prepare(recipe, seed=5, base=base)
    fresh.load_state_dict(saved)
    train(fresh, data[3:])
    ours, theirs = setup_tensors(fresh), setup_tensors(setup)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key


def _one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text
    return text


def test_bad_input_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"no nn\.Linear or Conv1D layer to convert") as e:
        small = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        amped.prepare(small, torch.optim.SGD(small.parameters(), lr=0.1), "fp8-tensorwise")
    assert "0 (8x8)" in _one_line(e)
    with pytest.raises(ValueError, match="float16 autocast is refused") as e:
        _prepare("fp8-rowwise", base="fp16-mixed")
    _one_line(e)
    with pytest.raises(ValueError, match="cannot take base='fp32'"):
        _prepare("fp8-rowwise", base="fp32")
    model = Net().to(torch.float16)
    with pytest.raises(ValueError, match="pass the model in float32") as e:
        amped.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp8-delayed")
    _one_line(e)
    model = Net()
    with pytest.raises(TypeError, match="RMSprop") as e:
        opt = torch.optim.RMSprop(model.parameters())
        amped.prepare(model, opt, "fp8-tensorwise", base="bf16-pure")
    with pytest.raises(ValueError, match="does not scale the loss"):
        _prepare("fp8-tensorwise", scaler=amped.GradScaler("cpu"))
    with pytest.raises(ValueError, match="FP8 and block recipes only"):
        _prepare("bf16-mixed", base="bf16-master")
    # nothing was converted by a refused prepare
    assert not any(isinstance(m, Float8Linear) for m in model.modules())


def test_prepare_adopts_layers_converted_beforehand_with_their_delayed_settings():
    from amped.lowp import Float8Config
    from amped.lowp.convert import convert_layers
    from amped.lowp.float8.config import FLOAT8_CONFIGS, DelayedScaling

    model = Net()
    convert_layers(model, Float8Config(delayed=DelayedScaling(64, "most_recent", 1)), ["fc2"])
    setup = amped.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp8-delayed")
    assert setup.low_precision_layers.names() == ["fc2"]  # adopted, nothing else converted
    train(setup, _data(2))
    assert setup.model.fc2.fp8_amax_history.shape == (3, 64)
    assert int(setup.model.fc2.fp8_updates) == 2
    other = Net()
    convert_layers(other, FLOAT8_CONFIGS["rowwise"], ["fc2"])
    with pytest.raises(ValueError, match="converted to FP8 with other rules"):
        amped.prepare(other, torch.optim.SGD(other.parameters(), lr=0.1), "fp8-delayed")
    with pytest.raises(ValueError, match="converted to FP8 with other rules"):
        amped.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp8-rowwise")
