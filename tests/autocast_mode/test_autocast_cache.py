"""The weight cache: one rule on every path, torch's.

A weight's low-precision cast is served until the outermost region closes: a weight
changed in place inside the region (an optimizer step, ``copy_`` under ``no_grad``) is
served stale, as ``torch.autocast`` serves it. A cast made under ``no_grad`` never
reaches a grad-enabled call (torch's own tests for pytorch/pytorch#158232), and nothing is
cached under ``inference_mode``. Every scenario runs on every path a region can take
(the policies below are chosen so each takes one; the model's ops get the same dtype
under each), and must match ``torch.autocast`` bitwise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
from tolerances import BITWISE

import amped
from amped.autocast_mode import current_path
from amped.autocast_mode.engine import forced_path
from amped.autocast_mode.state import Path

_TORCH = amped.Policy.preset("torch", "cpu")
# id -> (policy, context the region opens in, the path it must take)
PATHS = {
    "torch-default": (_TORCH, contextlib.nullcontext, Path.TORCH),
    "torch-module-rule-fp32": (
        _TORCH.with_module(nn.ReLU, "fp32"),
        contextlib.nullcontext,
        Path.TORCH,
    ),
    "kernels-changed-rule": (_TORCH.with_ops(fp32=["mm"]), contextlib.nullcontext, Path.KERNELS),
    "kernels-strict": (amped.Policy.preset("strict", "cpu"), contextlib.nullcontext, Path.KERNELS),
    "mode-module-rule-low": (
        _TORCH.with_module(nn.Linear, "low"),
        contextlib.nullcontext,
        Path.MODE,
    ),
    "mode-forced": (_TORCH, lambda: forced_path(Path.MODE), Path.MODE),
    "mode-amped-casts-only": (
        _TORCH,
        lambda: forced_path(Path.MODE, torch_alongside=False),
        Path.MODE,
    ),
}


@pytest.fixture(params=list(PATHS), ids=list(PATHS))
def region(request):
    policy, context, path = PATHS[request.param]

    @contextlib.contextmanager
    def open_region():
        with context(), amped.autocast("cpu", policy=policy):
            assert current_path("cpu") is path
            yield

    return open_region


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
def test_grad_mode_changes_never_lose_gradients(region, scenario):
    got = run(scenario, region)
    expected = run(scenario, lambda: torch.autocast("cpu"))
    assert_same(got, expected)
    assert all(g is not None for g in got[1]), "every weight gets its gradient"


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
def test_weight_changed_in_place_is_served_until_the_region_closes(region, scenario):
    got = run(scenario, region)
    stale = run(scenario, lambda: torch.autocast("cpu"))  # torch's cache: the old cast
    assert_same(got, stale)
    fresh = run(scenario, lambda: torch.autocast("cpu", cache_enabled=False))
    assert not torch.equal(got[0][1], fresh[0][1])  # (the scenario does change the weight)


def test_cache_is_dropped_when_the_outermost_region_closes(region):
    m = model()
    with region():
        first = m(X)
    with torch.no_grad():
        m[0].weight.add_(1)
    with region():
        again = m(X)
    with torch.autocast("cpu"):
        expected = m(X)
    assert not torch.equal(first, again)
    torch.testing.assert_close(again, expected, **BITWISE)
