"""Training-state bytes against closed forms (numel × element size), and peak memory."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from amped.comparison.footprint import PeakMemory, grad_bytes, state_bytes


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, dtype=torch.float32) -> int:
    model(torch.randn(4, 10, dtype=dtype)).float().sum().backward()
    grads = grad_bytes(model)
    optimizer.step()
    return grads


def test_fp32_adamw_is_16_bytes_per_parameter_plus_step_counters():
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
    assert state.source == "amped.memory_report"


def test_master_copies_the_optimizer_steps_are_counted_once():
    model = nn.Linear(10, 10).to(torch.bfloat16)
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    optimizer = torch.optim.SGD(masters, lr=0.1)
    model(torch.randn(4, 10, dtype=torch.bfloat16)).float().sum().backward()
    state = state_bytes(model, optimizer, grad_bytes(model))
    assert (state.params, state.grads, state.masters) == (110 * 2, 110 * 2, 110 * 4)
    assert state.optimizer_state == 0  # SGD without momentum keeps no state
    assert state.per_param == pytest.approx(8.0)


def test_tied_weights_count_once():
    embedding = nn.Embedding(5, 3)
    model = nn.Sequential(embedding, nn.Linear(3, 5, bias=False))
    model[1].weight = embedding.weight
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = state_bytes(model, optimizer, 0)
    assert state.params == 15 * 4
    assert state.param_count == 15
    model(torch.tensor([1, 2])).sum().backward()
    assert grad_bytes(model) == 15 * 4  # one gradient for the tied pair


def test_gradients_measured_after_backward_count_when_the_step_freed_them():
    model = nn.Linear(10, 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = _step(model, optimizer)
    model.weight.requires_grad_(False)  # memory_report now counts only the bias gradient
    assert state_bytes(model, optimizer, grads).grads == 110 * 4


def test_peak_rss_growth_sees_a_large_allocation():
    peak = PeakMemory(torch.device("cpu"))
    peak.start()
    if peak.kind != "rss_growth":
        pytest.skip("no /proc/self/statm here")
    block = torch.ones(16 * 2**20 // 4)  # 16 MiB, touched
    peak.sample()
    del block
    assert peak.peak_bytes() >= 12 * 2**20
