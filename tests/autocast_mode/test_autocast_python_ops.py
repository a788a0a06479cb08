"""``@amped.autocast_op`` functions where no mode is on the stack.

A policy that names such a function runs on the fast path (or, with module rules, in a
parked lean mode): the decorated function looks its rule up itself. Each case is
checked bitwise against the full mode engine (``forced_path(Path.MODE)``, which reaches the
function through the override protocol), outputs and every gradient.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
import torch.nn as nn
from tolerances import BITWISE
from torch.overrides import TorchFunctionMode

import amped
from amped.autocast_mode import current_path
from amped.autocast_mode.engine import forced_path
from amped.autocast_mode.state import Path

LOW_DTYPES = [torch.bfloat16, torch.float16]
_TORCH = amped.Policy.preset("torch", "cpu")


@amped.autocast_op
def gated(x, w):
    return torch.sigmoid(x) * (x @ w)


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x):
        return gated(x, self.w)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.gate, self.norm = nn.Linear(8, 8), Gate(), nn.LayerNorm(8)
        self.w = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x):
        h = gated(self.l1(x), self.w)  # outside any ruled module
        return self.norm(self.gate(h)).float().sum()


POLICIES = {  # name -> (policy, the path its regions take)
    "lower": (_TORCH.with_ops(lower=[gated]), Path.KERNELS),
    "fp32": (_TORCH.with_ops(fp32=[gated]), Path.KERNELS),
    "with-changed-rule": (_TORCH.with_ops(lower=[gated], fp32=["mm", "sigmoid"]), Path.KERNELS),
    "with-module-rule": (
        _TORCH.with_module(nn.LayerNorm, "fp32").with_ops(lower=[gated]),
        Path.KERNELS,
    ),
    "inside-ruled-module": (_TORCH.with_module(Gate, "fp32").with_ops(lower=[gated]), Path.KERNELS),
}


def _step(model, x, policy, dtype, force_engine):
    model.zero_grad()
    forced = forced_path(Path.MODE) if force_engine else contextlib.nullcontext()
    with forced, amped.autocast("cpu", dtype, policy=policy):
        path = current_path("cpu")
        loss = model(x)
    loss.backward()
    return loss, [p.grad.clone() for p in model.parameters()], path


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
@pytest.mark.parametrize("name", POLICIES)
def test_python_op_without_the_mode_equals_the_mode_engine(name, dtype):
    policy, path = POLICIES[name]
    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 8)
    loss, grads, got_path = _step(model, x, policy, dtype, force_engine=False)
    assert got_path is path
    ref_loss, ref_grads, ref_path = _step(model, x, policy, dtype, force_engine=True)
    assert ref_path is Path.MODE
    torch.testing.assert_close(loss, ref_loss, **BITWISE)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, **BITWISE)


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
def test_the_rule_casts_inputs_and_runs_with_autocast_off(dtype):
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with amped.autocast("cpu", dtype, policy=_TORCH.with_ops(lower=[gated])):
        got = gated(x, w)
    xl, wl = x.to(dtype), w.to(dtype)
    torch.testing.assert_close(got, torch.sigmoid(xl) * (xl @ wl), **BITWISE)
    with amped.autocast("cpu", dtype, policy=_TORCH.with_ops(fp32=[gated])):
        got = gated(xl, wl)  # sigmoid in float32 on the cast-up inputs, not autocast's
    xf, wf = xl.float(), wl.float()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.sigmoid(xf) * (xf @ wf), **BITWISE)


def test_outside_regions_and_where_autocast_is_off_it_is_the_plain_function():
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    plain = torch.sigmoid(x) * (x @ w)
    torch.testing.assert_close(gated(x, w), plain, **BITWISE)
    with amped.autocast("cpu", policy=_TORCH.with_ops(lower=[gated])):
        with torch.autocast("cpu", enabled=False):
            torch.testing.assert_close(gated(x, w), plain, **BITWISE)
        with amped.autocast("cpu", policy=_TORCH.with_ops(fp32=["mm"])):  # innermost rules
            assert gated(x, w).dtype == torch.float32  # unlisted: sigmoid fp32, mm fp32
        assert gated(x, w).dtype == torch.bfloat16


def test_weights_are_cast_once_per_region_and_get_their_gradients():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    xl, wl = x.to(torch.bfloat16), w.detach().to(torch.bfloat16)
    with amped.autocast("cpu", policy=_TORCH.with_ops(lower=[gated])):
        first, second = gated(x, w), gated(x, w)
        with torch.no_grad():  # a cast made here is never served to a grad-enabled call
            gated(x, w)
            w.add_(1.0)  # and a weight changed in place is served as cast before (torch's rule)
        third = gated(x, w)
    (first.sum() + second.sum() + third.sum()).float().backward()
    assert w.grad is not None and torch.isfinite(w.grad).all()
    torch.testing.assert_close(third, torch.sigmoid(xl) * (xl @ wl), **BITWISE)


def test_overrides_still_see_the_function_as_one_call():
    seen = []

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with amped.autocast("cpu", policy=_TORCH.with_ops(lower=[gated])), Watch():
        got = gated(x, w)
    assert seen[0] is gated and got.dtype == torch.bfloat16  # the rule applied once


def test_each_thread_applies_its_own_regions():
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    inside, release, other = threading.Event(), threading.Event(), {}

    def plain():
        inside.wait()
        other["dtype"] = gated(x, w).dtype  # no region on this thread
        release.set()

    worker = threading.Thread(target=plain)
    worker.start()
    with amped.autocast("cpu", policy=_TORCH.with_ops(lower=[gated])):
        inside.set()
        release.wait()
        assert gated(x, w).dtype == torch.bfloat16
    worker.join()
    assert other["dtype"] == torch.float32
