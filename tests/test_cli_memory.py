"""Training-state bytes against closed forms (numel × element size), and peak memory."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import amped
from amped.cli.memory import PeakMemory, grad_bytes, state_bytes


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, dtype=torch.float32) -> int:
    model(torch.randn(4, 10, dtype=dtype)).float().sum().backward()
    grads = grad_bytes(model)
    optimizer.step()
    return grads


@pytest.fixture
def own_count(monkeypatch):
    """Count with amped.cli's own code, even where amped.memory_report exists."""
    monkeypatch.delattr(amped, "memory_report", raising=False)


def test_fp32_adamw_is_16_bytes_per_parameter_plus_step_counters(own_count):
    model = nn.Linear(10, 10)  # 110 parameters in 2 tensors
    optimizer = torch.optim.AdamW(model.parameters())
    state = state_bytes(model, optimizer, _step(model, optimizer))
    assert state.param_count == 110
    assert (state.params, state.grads, state.masters) == (110 * 4, 110 * 4, 0)
    step_counters = sum(
        s["step"].untyped_storage().nbytes() for s in optimizer.state.values()
    )  # AdamW keeps a scalar step tensor per parameter tensor
    assert state.optimizer_state == 2 * 110 * 4 + step_counters
    assert state.per_param == pytest.approx((16 * 110 + step_counters) / 110)
    assert state.source == "amped.cli"


def test_master_copies_the_optimizer_steps_are_counted_once(own_count):
    model = nn.Linear(10, 10).to(torch.bfloat16)
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    optimizer = torch.optim.SGD(masters, lr=0.1)
    model(torch.randn(4, 10, dtype=torch.bfloat16)).float().sum().backward()
    state = state_bytes(model, optimizer, grad_bytes(model))
    assert (state.params, state.grads, state.masters) == (110 * 2, 110 * 2, 110 * 4)
    assert state.optimizer_state == 0  # SGD without momentum keeps no state
    assert state.per_param == pytest.approx(8.0)


def test_tied_weights_count_once(own_count):
    embedding = nn.Embedding(5, 3)
    model = nn.Sequential(embedding, nn.Linear(3, 5, bias=False))
    model[1].weight = embedding.weight
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = state_bytes(model, optimizer, 0)
    assert state.params == 15 * 4
    assert state.param_count == 15


@pytest.mark.skipif(not hasattr(amped, "memory_report"), reason="no amped.memory_report yet")
@pytest.mark.parametrize("recipe", ["fp32", "bf16-mixed", "bf16-master", "bf16-pure"])
def test_own_count_agrees_with_amped_memory_report(monkeypatch, recipe):
    model = nn.Sequential(nn.Linear(10, 10), nn.LayerNorm(10), nn.Linear(10, 3))
    setup = amped.prepare(model, torch.optim.AdamW(model.parameters()), recipe)
    with setup.autocast():
        setup.backward(setup.model(torch.randn(4, 10)).float().sum())
    grads = grad_bytes(setup.model)
    setup.step()
    reported = state_bytes(setup.model, setup.optimizer, grads)
    monkeypatch.delattr(amped, "memory_report")
    counted = state_bytes(setup.model, setup.optimizer, grads)
    assert reported.source == "amped.memory_report" and counted.source == "amped.cli"
    assert reported.total == counted.total
    assert reported.per_param == counted.per_param


def test_memory_report_is_preferred_when_the_recipes_layer_offers_it(monkeypatch):
    figures = {"params": 1, "grads": 2, "optimizer_state": 3, "masters": 4}
    monkeypatch.setattr(amped, "memory_report", lambda model, opt: figures, raising=False)
    model = nn.Linear(2, 2)
    state = state_bytes(model, torch.optim.SGD(model.parameters(), lr=0.1), 0)
    assert (state.params, state.grads, state.optimizer_state, state.masters) == (1, 2, 3, 4)
    assert state.source == "amped.memory_report"


def test_an_unrecognised_memory_report_falls_back_to_counting(monkeypatch):
    monkeypatch.setattr(amped, "memory_report", lambda model, opt: "a table", raising=False)
    model = nn.Linear(2, 2)
    state = state_bytes(model, torch.optim.SGD(model.parameters(), lr=0.1), 0)
    assert state.source == "amped.cli"
    assert state.params == 6 * 4


def test_peak_rss_growth_sees_a_large_allocation():
    peak = PeakMemory(torch.device("cpu"))
    peak.start()
    if peak.kind != "rss_growth":
        pytest.skip("no /proc/self/statm here")
    block = torch.ones(16 * 2**20 // 4)  # 16 MiB, touched
    peak.sample()
    del block
    assert peak.peak_bytes() >= 12 * 2**20
