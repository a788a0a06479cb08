"""prepare() says what it installed, and teardown() leaves the model as it was."""

from __future__ import annotations

import sys

import pytest
import torch

import amped


def make_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2)
    )
    model.register_buffer("table", torch.randn(3))  # lowered with the model's own weights
    return model


@pytest.mark.parametrize(
    "recipe", ["fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master"]
)
def test_teardown_leaves_the_model_and_optimizer_as_they_were(recipe):
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    groups = [list(g["params"]) for g in opt.param_groups]
    setup = amped.prepare(model, opt, recipe)
    installed = setup.installed
    if recipe.endswith("master"):
        assert installed.hook is not None
        assert len(installed.params) == 4  # the Linear weights and biases; BatchNorm stays
        assert [key for _, key, _, _ in installed.buffers] == ["table"]
    else:
        assert installed is None
    setup.teardown()
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    assert list(model.parameters()) == params
    assert [list(g["params"]) for g in opt.param_groups] == groups  # O2's masters gone
    assert not model._forward_pre_hooks
    setup.teardown()  # idempotent


def test_teardown_after_training_keeps_the_trained_float32_masters():
    model = make_model()
    original_table = model.table
    setup = amped.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16-master")
    with setup.autocast():
        loss = setup.model(torch.randn(5, 4)).float().sum()
    setup.backward(loss)
    setup.step()
    masters = setup.fp32_state_dict()
    setup.teardown()
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in masters.items() if k != "table")
    # A buffer training left alone gets its original float32 tensor back.
    assert model.table is original_table
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_teardown_of_bf16_pure_gives_float32_weights_with_compensation():
    model = make_model()
    setup = amped.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16-pure")
    assert len(setup.installed.params) == 6
    with setup.autocast():
        loss = setup.model(torch.randn(5, 4)).float().sum()
    setup.backward(loss)
    setup.step()
    expected = setup.fp32_state_dict()
    setup.teardown()
    # The original float32 weights are not kept (that is the memory bf16-pure saves):
    # each weight comes back as bfloat16 weight + compensation, in float32.
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in expected.items() if k != "table")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert not model._forward_pre_hooks


@pytest.mark.slow
def test_importing_amped_imports_no_framework():
    code = (
        "import sys, amped, amped.integrations.common, amped.integrations.driver; "
        "print(sorted(m for m in ('lightning', 'accelerate', 'transformers') if m in sys.modules))"
    )
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
