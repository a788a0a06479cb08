"""Optimizer in backward: each parameter stepped in its gradient hook, gradients freed."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from recipes_helpers import batches

import amped
from amped.optim import CompensatedSGD, step_in_backward
from amped.optim.adamw8bit import CompensatedAdamW8bit


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 8)).bfloat16()


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x.bfloat16()).float(), y)


def _optimizers():
    return {
        "8bit-stochastic": lambda ps: CompensatedAdamW8bit(ps, lr=1e-2, fused=False),
        "8bit-kahan": lambda ps: CompensatedAdamW8bit(ps, lr=1e-2, compensation="kahan"),
        # (CompensatedAdamW rounds its second moment stochastically under both
        # compensations, with bits drawn per step() call: in backward, per parameter.)
        "sgd-kahan": lambda ps: CompensatedSGD(ps, lr=1e-2, momentum=0.9, fused=False),
    }


def _ordinary(make, data, max_norm: float | None = None) -> nn.Module:
    """The ordinary loop; with max_norm, gradients scaled as the hooks document."""
    model = _model()
    opt = make(model.parameters())
    last = None
    for x, y in data:
        _loss(model, x, y).backward()
        grads = [p.grad for p in model.parameters()]
        norm = torch.stack([g.float().square().sum() for g in grads])
        squares = norm[0]
        for value in norm[1:]:
            squares = squares + value  # the hooks' order: the last layer first
        if max_norm is not None and last is not None:
            coef = (max_norm / (last + 1e-6)).clamp(max=1.0).to(torch.bfloat16)
            for g in grads:
                g.mul_(coef)
        last = squares.sqrt()
        opt.step()
        opt.zero_grad()
    return model


def _hooked(make, data, max_norm: float | None = None) -> tuple[nn.Module, list[float]]:
    model = _model()
    opt = make(model.parameters())
    hooks = step_in_backward(opt, max_norm=max_norm)
    norms = []
    for x, y in data:
        _loss(model, x, y).backward()
        assert all(p.grad is None for p in model.parameters())  # freed in the hooks
        opt.step()  # closes the step
        assert hooks.last_norm is not None
        norms.append(hooks.last_norm.item())
    return model, norms


@pytest.mark.parametrize("name", list(_optimizers()))
def test_in_backward_equals_the_ordinary_step(name: str) -> None:
    make, data = _optimizers()[name], batches(4)
    reference = _ordinary(make, data)
    model, _ = _hooked(make, data)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("name", ["8bit-kahan", "sgd-kahan"])
def test_clipping_by_the_previous_steps_norm(name: str) -> None:
    make, data = _optimizers()[name], batches(4)
    # max_norm far below the gradients' norm (about 1-3): every step after the first is
    # clipped, so the comparison would catch a missing or misplaced clip.
    reference = _ordinary(make, data, max_norm=0.05)
    model, norms = _hooked(make, data, max_norm=0.05)
    assert min(norms) > 0.05
    unclipped = _ordinary(make, data)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)
    pairs = zip(model.parameters(), unclipped.parameters(), strict=True)
    assert not all(torch.equal(p, r) for p, r in pairs)


@pytest.mark.parametrize("name", list(_optimizers()))
def test_gradient_accumulation_is_refused(name: str) -> None:
    model = _model()
    opt = _optimizers()[name](model.parameters())
    step_in_backward(opt)
    (x, y), (x2, y2) = batches(2)
    _loss(model, x, y).backward()
    with pytest.raises(RuntimeError, match="accumulate gradients"):
        _loss(model, x2, y2).backward()


def test_remove_restores_the_ordinary_step() -> None:
    model = _model()
    opt = CompensatedAdamW8bit(model.parameters(), fused=False)
    hooks = step_in_backward(opt)
    with pytest.raises(ValueError, match="already"):
        step_in_backward(opt)
    hooks.remove()
    (x, y), *_ = batches(1)
    _loss(model, x, y).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_refuses_other_optimizers() -> None:
    model = _model()
    with pytest.raises(TypeError, match="bf16-pure optimizer"):
        step_in_backward(torch.optim.AdamW(model.parameters()))


@pytest.mark.slow  # transformers' import and a GPT-2 step: about 7 s
def test_memory_report_under_4_1_bytes_per_param() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_embd=256, n_head=4, n_positions=128, vocab_size=1024)
    )
    setup = amped.prepare(model, torch.optim.AdamW(model.parameters()), "bf16-pure-8bit")
    step_in_backward(setup.optimizer, max_norm=1.0)
    ids = torch.randint(0, 1024, (2, 16), generator=torch.Generator().manual_seed(0))
    setup.backward(setup.model(input_ids=ids, labels=ids).loss)
    assert setup.step()
    report = amped.memory_report(setup.model, setup.optimizer)
    params = list(setup.model.parameters())
    assert report.grads == 0
    assert report.transient_grads == max(2 * p.numel() for p in params)
    assert report.peak == report.total + report.transient_grads
    assert report.bytes_per_param <= 4.1


@pytest.mark.slow  # the examples' 8192-element weights compile the fused 8-bit kernel
@pytest.mark.parametrize("module", ["amped.optim.in_backward", "amped.optim.adamw8bit"])
def test_docstring_examples_run(module: str) -> None:
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def _saved(state: dict) -> dict:
    """``state`` through a checkpoint file's bytes, loaded as amped loads (weights only)."""
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("name", ["8bit-kahan", "sgd-kahan"])
def test_resume_with_clipping_is_bitwise(name: str) -> None:
    """The clipping norm of the last step travels in the optimizer's state: a run
    resumed from a checkpoint clips its first step as the uninterrupted run does."""
    make, data = _optimizers()[name], batches(6)
    whole, _ = _hooked(make, data, max_norm=0.05)  # clipped from the second step on
    model = _model()
    opt = make(model.parameters())
    step_in_backward(opt, max_norm=0.05)
    for x, y in data[:3]:
        _loss(model, x, y).backward()
        opt.step()
    state = _saved({"model": model.state_dict(), "optimizer": opt.state_dict()})
    resumed = _model(seed=1)
    opt = make(resumed.parameters())
    step_in_backward(opt, max_norm=0.05)  # before loading: its hooks read the norm back
    resumed.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    for x, y in data[3:]:
        _loss(resumed, x, y).backward()
        opt.step()
    for p, q in zip(resumed.parameters(), whole.parameters(), strict=True):
        assert torch.equal(p, q)


def test_clipping_after_a_load_without_hooks_warns() -> None:
    model = _model()
    opt = CompensatedSGD(model.parameters(), lr=1e-2, momentum=0.9, fused=False)
    (x, y), *_ = batches(1)
    _loss(model, x, y).backward()
    opt.step()
    with pytest.warns(RuntimeWarning, match="next step is not clipped"):
        step_in_backward(opt, max_norm=1.0)


def test_monitor_and_in_backward_refuse_each_other_in_either_order() -> None:
    """Under optimizer-in-backward the gradients are stepped and freed before the
    monitor could check them: a NaN gradient would poison a weight unnamed."""
    model = nn.Sequential(nn.Linear(32, 8))
    setup = amped.prepare(model, torch.optim.AdamW(model.parameters()), "bf16-pure")
    hooks = step_in_backward(setup.optimizer)
    with pytest.raises(ValueError, match="step_in_backward"):
        amped.monitor(setup)
    assert setup.monitor is None
    hooks.remove()
    health = amped.monitor(setup)
    with pytest.raises(ValueError, match=r"amped\.monitor checks each step's gradients"):
        step_in_backward(setup.optimizer)
    health.detach()
    step_in_backward(setup.optimizer)  # alone again: allowed
