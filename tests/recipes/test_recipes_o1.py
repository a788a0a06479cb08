"""amped.prepare for the autocast recipes (fp32, bf16-mixed, fp16-mixed): the setup's
loop equals the hand-written torch loop bitwise, and bad input is refused clearly."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from tolerances import BITWISE

import amped
from amped.recipes.registry import RECIPES, resolve_recipe


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))


def _data(steps=5):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
        for _ in range(steps)
    ]


def _amped_loop(recipe):
    model = _model()
    setup = amped.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2), recipe)
    for x, y in _data():
        with setup.autocast():
            loss = F.cross_entropy(setup.model(x), y)
        setup.backward(loss)
        setup.step()
        setup.zero_grad()
    return [p.detach() for p in model.parameters()]


def _torch_loop(dtype, scaling):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", enabled=scaling)
    for x, y in _data():
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize(
    ("recipe", "dtype", "scaling"),
    [
        ("fp32", None, False),
        ("bf16-mixed", torch.bfloat16, False),
        ("fp16-mixed", torch.float16, True),
    ],
)
def test_setup_loop_equals_torch_loop(recipe, dtype, scaling):
    for got, expected in zip(_amped_loop(recipe), _torch_loop(dtype, scaling), strict=True):
        torch.testing.assert_close(got, expected, **BITWISE)


def test_aliases_resolve():
    assert resolve_recipe("O1").name == "fp16-mixed"
    assert resolve_recipe("BF16").name == "bf16-mixed"
    assert resolve_recipe("O0").name == "fp32"
    assert all(resolve_recipe(r) is r for r in RECIPES.values())


def test_bad_input_is_refused():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="Unknown recipe 'fp8'"):
        amped.prepare(model, opt, "fp8")
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        amped.prepare(model, "sgd")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not the model's"):
        amped.prepare(model, torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    with pytest.raises(ValueError, match="one device type"):
        amped.prepare(nn.ReLU(), opt)
    setup = amped.prepare(model, opt, "bf16-mixed")
    with pytest.raises(ValueError, match="written by recipe 'fp32'"):
        setup.load_state_dict({**setup.state_dict(), "recipe": "fp32"})
