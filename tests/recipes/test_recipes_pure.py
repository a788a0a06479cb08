"""bf16-pure through amped.prepare: bfloat16 everywhere, the user's optimizer replaced by
its compensated twin with the same hyper-parameters, and clear refusals."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn as nn
from recipes_helpers import batches, mlp, train
from tolerances import BITWISE

import amped
from amped.optim import CompensatedAdamW, CompensatedSGD
from amped.recipes.weights import cast_inputs


def test_everything_is_bf16_and_the_optimizer_is_the_twin():
    model = mlp()
    opt = torch.optim.AdamW(
        [
            {"params": model[0].parameters(), "lr": 1e-3},
            {"params": [*model[1].parameters(), *model[3].parameters()], "weight_decay": 0.0},
        ],
        lr=2e-3,
        betas=(0.8, 0.95),
        eps=1e-6,
    )
    setup = amped.prepare(model, opt, "bf16-pure")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    twin = setup.optimizer
    assert isinstance(twin, CompensatedAdamW)
    assert [g["lr"] for g in twin.param_groups] == [1e-3, 2e-3]
    assert [g["weight_decay"] for g in twin.param_groups] == [1e-2, 0.0]
    assert all(g["betas"] == (0.8, 0.95) and g["eps"] == 1e-6 for g in twin.param_groups)
    assert all(
        g["decoupled_weight_decay"] and g["compensation"] == "kahan" for g in twin.param_groups
    )
    assert twin.param_groups[0]["params"][0] is model[0].weight
    train(setup, batches(2))
    tensors = [v for s in twin.state.values() for v in s.values() if torch.is_tensor(v)]
    assert tensors and {t.dtype for t in tensors} == {torch.bfloat16}
    assert {p.grad is None for p in model.parameters()} == {True}


@pytest.mark.parametrize(
    ("make", "recipe", "cls", "expected"),
    [
        (
            lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
            "bf16-pure",
            CompensatedSGD,
            dict(momentum=0.9, nesterov=True, compensation="kahan"),
        ),
        (
            lambda p: torch.optim.Adam(p, lr=0.1, weight_decay=0.1),
            "bf16-pure-sr",
            CompensatedAdamW,
            dict(decoupled_weight_decay=False, compensation="stochastic"),
        ),
        (
            lambda p: torch.optim.SGD(p, lr=torch.tensor(0.1)),
            "pure-bf16",
            CompensatedSGD,
            dict(lr=pytest.approx(0.1)),
        ),
    ],
    ids=["sgd-nesterov", "adam-l2-sr", "tensor-lr"],
)
def test_twin_keeps_the_hyper_parameters(make, recipe, cls, expected):
    model = mlp()
    setup = amped.prepare(model, make(model.parameters()), recipe)
    assert isinstance(setup.optimizer, cls)
    group = setup.optimizer.param_groups[0]
    assert {k: group[k] for k in expected} == expected


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (
            lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9, nesterov=True),
            dict(lr=0.5, momentum=0.9, nesterov=True, weight_decay=0.0),
        ),
        (
            lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.9)),
            dict(lr=0.01, betas=(0.8, 0.9), weight_decay=0.0, decoupled_weight_decay=False),
        ),
        (
            lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.2),
            dict(lr=0.01, weight_decay=0.2, decoupled_weight_decay=True),
        ),
    ],
    ids=["sgd-nesterov", "adam", "adamw"],
)
def test_twin_keeps_the_users_defaults_for_added_groups(make, expected):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    optimizer = make(model[0].parameters())
    setup = amped.prepare(model, optimizer, "bf16-pure")
    assert {k: setup.optimizer.defaults[k] for k in expected} == expected
    setup.optimizer.add_param_group({"params": list(model[1].parameters())})
    added = setup.optimizer.param_groups[1]
    assert {k: added[k] for k in expected} == expected


def test_a_compensated_optimizer_is_used_as_it_is():
    model = mlp()
    opt = CompensatedSGD(model.parameters(), lr=0.1, compensation="stochastic", seed=4)
    assert amped.prepare(model, opt, "bf16-pure").optimizer is opt


def test_policy_kept_module_stays_fp32_and_steps_plainly():
    model = mlp()
    policy = amped.Policy.preset("torch", "cpu").with_module("3", "fp32")
    setup = amped.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16-pure", policy=policy
    )
    assert model[3].weight.dtype is torch.float32 and model[0].weight.dtype is torch.bfloat16
    train(setup, batches(1))
    assert "compensation" not in setup.optimizer.state[model[3].weight]
    assert "compensation" in setup.optimizer.state[model[0].weight]


def test_fp32_state_dict_adds_the_compensation():
    model = mlp()
    setup = amped.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3), "bf16-pure")
    train(setup, batches(3))
    full = setup.fp32_state_dict()
    comp = setup.optimizer.state[model[0].weight]["compensation"]
    assert comp.abs().max() > 0
    torch.testing.assert_close(full["0.weight"], model[0].weight.float() + comp.float(), **BITWISE)
    plain = mlp(seed=1)
    plain.load_state_dict(full)  # a plain float32 model takes it as it is


@pytest.mark.parametrize("recipe", ["bf16-pure", "bf16-master"])
def test_float32_inputs_meet_no_low_weight_outside_autocast_lists(recipe):
    # nn.TransformerEncoderLayer adds its float32 input to a bfloat16 attention output
    # and feeds the sum to layer_norm, which CPU autocast does not list: the lowered
    # model must cast its inputs, or layer_norm sees float32 input, bfloat16 weight.
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    setup = amped.prepare(model, torch.optim.AdamW(model.parameters()), recipe)
    with setup.autocast():
        loss = setup.model(torch.randn(2, 5, 16)).float().pow(2).mean()
    setup.backward(loss)
    assert setup.step()


def test_cast_inputs_reaches_nested_and_keyword_arguments():
    seen = []

    class Probe(nn.Module):
        def forward(self, pair, *, extra, ids):
            seen.extend([pair[0].dtype, pair[1]["x"].dtype, extra.dtype, ids.dtype])
            return pair[0]

    probe = Probe()
    cast_inputs(probe, torch.bfloat16)
    probe(
        (torch.ones(1), {"x": torch.ones(1)}),
        extra=torch.ones(1, dtype=torch.float64),
        ids=torch.ones(1, dtype=torch.long),
    )
    assert seen == [torch.bfloat16, torch.bfloat16, torch.float64, torch.long]


def test_cast_inputs_casts_float32_only_and_keeps_every_container():
    Batch = collections.namedtuple("Batch", "x mask names")
    seen = {}

    class Probe(nn.Module):
        def forward(self, batch, rest):
            seen.update(batch=batch, rest=rest)
            return batch.x

    probe = Probe()
    cast_inputs(probe, torch.bfloat16)
    half, ids = torch.ones(1, dtype=torch.float16), torch.arange(2)
    probe(Batch(torch.ones(1), half, ["a"]), [ids, (None, 3, torch.ones(1))])
    batch, rest = seen["batch"], seen["rest"]
    assert type(batch) is Batch and batch.x.dtype is torch.bfloat16
    assert batch.mask is half and batch.names == ["a"]  # float16: not float32, untouched
    assert type(rest) is list and rest[0] is ids and rest[1][:2] == (None, 3)
    assert rest[1][2].dtype is torch.bfloat16


def test_bad_input_is_refused():
    model = mlp()
    with pytest.raises(TypeError, match=r"SGD, Adam and AdamW; RMSprop has none.*bf16-master"):
        amped.prepare(model, torch.optim.RMSprop(model.parameters()), "bf16-pure")
    assert model[0].weight.dtype is torch.float32  # refused before anything changed
    with pytest.raises(ValueError, match=r"no amsgrad mode\. Received: amsgrad=True"):
        amped.prepare(model, torch.optim.AdamW(model.parameters(), amsgrad=True), "bf16-pure")
    stepped = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 32)).sum().backward()
    stepped.step()
    with pytest.raises(ValueError, match=r"has stepped already.*before the\s+first step"):
        amped.prepare(model, stepped, "bf16-pure")
    with pytest.warns(
        UserWarning, match=r"needs no loss scaling.*Received: scaler.is_enabled\(\)=True"
    ):
        amped.prepare(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            "bf16-pure",
            scaler=amped.GradScaler("cpu"),
        )


def test_recipes_are_validated():
    loop: dict = dict(autocast=True, loss_scaling=False, aliases=(), summary="")
    with pytest.raises(ValueError, match=r"needs a low dtype.*Received: dtype=None"):
        amped.Recipe("x", dtype=None, weights="low", compensation="kahan", **loop)
    with pytest.raises(ValueError, match=r"compensation .* is required for weights='low'"):
        amped.Recipe("x", dtype=torch.bfloat16, weights="low", **loop)
    with pytest.raises(ValueError, match=r"Received: weights='half'"):
        amped.Recipe("x", dtype=torch.bfloat16, weights="half", **loop)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="positional"):
        amped.Recipe("x", torch.bfloat16, "fp32", True, False, (), "")  # type: ignore[misc]
    assert amped.recipes.registry.resolve_recipe("O2").name == "fp16-master"
    assert amped.recipes.registry.resolve_recipe("bf16-kahan").name == "bf16-pure"
