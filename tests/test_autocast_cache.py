"""The engine's weight cache under grad-mode changes, inference mode and in-place updates.

torch's own autocast tests for pytorch issue 158232 (a weight cast under ``no_grad``
served to a later grad-enabled call, so the weight silently got no gradient), ported to
amped's engine and run for each way a user enters it: a changed op rule, a module rule
(to float32 and to low precision) and the ``"strict"`` preset. Each scenario runs under
``torch.autocast`` too (torch >= 2.10 has the fix) and must match it bitwise: the model's
ops (linear, relu) get the same dtype under every policy here, so torch is the oracle.
Beyond torch: a weight changed in place inside the region is cast again, not served
stale; there the oracle is torch without its cache.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn as nn

import amped
from amped.autocast_mode import state
from tolerances import BITWISE

_TORCH = amped.Policy.preset("torch", "cpu")
POLICIES = {
    "changed-rule": _TORCH.with_ops(fp32=["mm"]),
    "module-rule-fp32": _TORCH.with_module(nn.ReLU, "fp32"),  # relu is exact in any dtype
    "module-rule-low": _TORCH.with_module(nn.Linear, "low"),
    "strict": amped.Policy.preset("strict", "cpu"),
}


@pytest.fixture(params=list(POLICIES), ids=list(POLICIES))
def policy(request):
    assert state.needs_engine(POLICIES[request.param])
    return POLICIES[request.param]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


X = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))


def run(scenario: Callable[[nn.Module], list[torch.Tensor]], region: Callable[[], object]):
    """Run ``scenario`` in a fresh model inside ``region()``; outputs, then gradients."""
    m = model()
    with region():  # type: ignore[attr-defined]
        outs = scenario(m)
    loss = sum(o.float().sum() for o in outs if o.requires_grad)
    if isinstance(loss, torch.Tensor):
        loss.backward()
    grads = [p.grad for p in m.parameters()]
    return outs, grads


def assert_same(got, expected):
    (got_outs, got_grads), (exp_outs, exp_grads) = got, expected
    assert [o.requires_grad for o in got_outs] == [o.requires_grad for o in exp_outs]
    for g, e in zip(got_outs, exp_outs, strict=True):
        assert g.dtype == e.dtype
        torch.testing.assert_close(g, e, **BITWISE)
    for g, e in zip(got_grads, exp_grads, strict=True):
        assert (g is None) == (e is None), "a weight lost (or gained) its gradient"
        if g is not None:
            torch.testing.assert_close(g, e, **BITWISE)


def no_grad_then_grad(m):
    with torch.no_grad():
        first = m(X)
    return [first, m(X)]


def inference_mode_then_grad(m):
    with torch.inference_mode():
        first = m(X).clone()
    return [first, m(X)]


def grad_no_grad_grad(m):
    a = m(X)
    with torch.no_grad():
        b = m(X)
    return [a, b, m(X)]


def set_grad_enabled_toggles(m):
    outs = []
    for enabled in (False, True, False, True):
        with torch.set_grad_enabled(enabled):
            outs.append(m(X))
    return outs


class _Scaled(torch.autograd.Function):
    """Casts happen inside forward, where autograd is off (pytorch PR 113685's case)."""

    @staticmethod
    def forward(ctx, x, lin):
        return lin(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def custom_function_then_grad(m):
    first = _Scaled.apply(X, m[0])
    return [first, m(X)]


SCENARIOS = {
    "no_grad-then-grad": no_grad_then_grad,
    "inference_mode-then-grad": inference_mode_then_grad,
    "grad-no_grad-grad": grad_no_grad_grad,
    "set_grad_enabled-toggles": set_grad_enabled_toggles,
    "autograd-Function-then-grad": custom_function_then_grad,
}


@pytest.mark.parametrize("scenario", list(SCENARIOS.values()), ids=list(SCENARIOS))
def test_grad_mode_changes_never_lose_gradients(policy, scenario):
    got = run(scenario, lambda: amped.autocast("cpu", policy=policy))
    expected = run(scenario, lambda: torch.autocast("cpu"))
    assert_same(got, expected)
    assert all(g is not None for g in got[1]), "every weight gets its gradient"


@pytest.mark.parametrize("scenario", list(SCENARIOS.values()), ids=list(SCENARIOS))
def test_engine_forced_on_torch_rules_matches_torch(scenario):
    def region():
        stack = __import__("contextlib").ExitStack()
        stack.enter_context(state.engine_always())
        stack.enter_context(amped.autocast("cpu"))
        return stack

    assert_same(run(scenario, region), run(scenario, lambda: torch.autocast("cpu")))


def optimizer_step_inside_region(m):
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    first = m(X)
    first.float().sum().backward()
    opt.step()  # in place, under no_grad: the weights' version counters move
    opt.zero_grad(set_to_none=True)
    return [first.detach(), m(X)]


def copy_under_no_grad(m):
    first = m(X)
    with torch.no_grad():
        m[0].weight.copy_(torch.ones_like(m[0].weight))
    return [first.detach(), m(X)]


IN_PLACE = {
    "optimizer-step": optimizer_step_inside_region,
    "copy_-under-no_grad": copy_under_no_grad,
}


@pytest.mark.parametrize("scenario", list(IN_PLACE.values()), ids=list(IN_PLACE))
def test_weight_changed_in_place_is_cast_again(policy, scenario):
    got = run(scenario, lambda: amped.autocast("cpu", policy=policy))
    fresh = run(scenario, lambda: torch.autocast("cpu", cache_enabled=False))
    assert_same(got, fresh)
    stale = run(scenario, lambda: torch.autocast("cpu"))  # torch's cache serves the old cast
    assert not torch.equal(got[0][1], stale[0][1])


def test_cache_entries_are_per_grad_mode_and_skip_inference_mode(monkeypatch):
    monkeypatch.setattr(state, "FAST_PATH", False)  # the engine's cache (fast path: elsewhere)
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(2, 4)
    with amped.autocast("cpu", policy="strict"):
        cache = state._state.mode.cache
        with torch.inference_mode():
            torch.nn.functional.linear(x, w)
        assert len(cache) == 0
        with torch.no_grad():
            torch.nn.functional.linear(x, w)
            torch.nn.functional.linear(x, w)
        assert len(cache) == 1
        out = torch.nn.functional.linear(x, w)
        assert len(cache) == 2 and out.requires_grad
