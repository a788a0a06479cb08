"""The one float32-module rule: a module run in float32 gets its floating inputs,
positional and keyword (nested in tuples, lists and dicts too), in float32, and runs
with autocast off, as ``torch.amp.custom_fwd(cast_inputs=torch.float32)`` runs a
function; under a policy's ``"fp32"`` module rule and under the O2 recipes' norm hooks
alike."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
from tolerances import BITWISE

import amped
from amped.autocast_mode import compiling

_TORCH = amped.Policy.preset("torch", "cpu")


class _NestedNorm(nn.LayerNorm):
    """A norm layer whose inputs come nested: a pair, and keyword tensors in a list and
    a dict. Records the dtypes it received."""

    def forward(self, pair, *, shifts=(), scales=None):  # type: ignore[override]
        self.seen = [t.dtype for t in (*pair, *shifts, *(scales or {}).values())]
        x = pair[0] + pair[1] + sum(shifts)
        return super().forward(x) * (scales or {}).get("out", 1)


def _bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).bfloat16()


def _layer_norm() -> tuple[nn.Module, Callable[[nn.Module], Any]]:
    x = _bf16(2, 3, 8)
    return nn.LayerNorm(8), lambda m: m(input=x)


def _attention() -> tuple[nn.Module, Callable[[nn.Module], Any]]:
    q, k, v = _bf16(2, 3, 8), _bf16(2, 5, 8), _bf16(2, 5, 8)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    return mha, lambda m: m(query=q, key=k, value=v, need_weights=False)[0]


def _nested() -> tuple[nn.Module, Callable[[nn.Module], Any]]:
    x = _bf16(2, 8)
    return _NestedNorm(8), lambda m: m((x, x), shifts=[x, x], scales={"out": x})


CALLS = {"layer_norm": _layer_norm, "attention": _attention, "nested": _nested}


def _oracle(module: nn.Module, call: Callable[[nn.Module], Any]) -> Any:
    """What torch's ``custom_fwd(cast_inputs=torch.float32)`` gives: it casts the
    arguments of the function it decorates, here one that forwards them to ``module``."""

    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, *args, **kwargs):  # (custom_fwd decorates a Function's forward)
        return module(*args, **kwargs)

    class Recorder:  # the call, with module(...) replaced by the decorated function
        def __call__(self, *args, **kwargs):
            return forward(types.SimpleNamespace(), *args, **kwargs)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        return call(Recorder())  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(CALLS))
def test_an_fp32_module_rule_casts_keyword_inputs_as_custom_fwd(name):
    torch.manual_seed(0)
    module, call = CALLS[name]()
    expected = _oracle(module, call)
    with amped.autocast("cpu", policy=_TORCH.with_module(type(module), "fp32")):
        got = call(module)
    assert got.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(got, expected, **BITWISE)
    if name == "nested":
        assert module.seen == [torch.float32] * 5


@pytest.mark.parametrize("name", ["layer_norm", "nested"])
def test_o2_norm_hooks_cast_keyword_inputs_as_the_module_rule(name):
    # The O2 recipe keeps norm layers in float32 by hooks of their own, not a policy
    # rule: the same rule, so the same result as the rule and as custom_fwd.
    torch.manual_seed(0)
    norm, call = CALLS[name]()
    model = nn.Sequential(nn.Linear(8, 8), norm)
    setup = amped.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16-master")
    assert model[0].weight.dtype is torch.bfloat16 and norm.weight.dtype is torch.float32
    expected = _oracle(norm, call)
    with setup.autocast():
        got = call(norm)
    with amped.autocast("cpu", policy=_TORCH.with_module(type(norm), "fp32")):
        ruled = call(norm)
    torch.testing.assert_close(got, expected, **BITWISE)
    torch.testing.assert_close(ruled, expected, **BITWISE)


def test_an_fp32_module_called_again_without_its_rule_gets_its_inputs_as_they_are():
    # The rule leaves nothing behind on the module: its next call, under a region whose
    # rules do not match it or under no region, runs as under torch's autocast alone.
    torch.manual_seed(0)
    module, call = _layer_norm()
    with amped.autocast("cpu", policy=_TORCH.with_module(nn.LayerNorm, "fp32")):
        assert call(module).dtype is torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = call(module)
    with amped.autocast("cpu", policy=_TORCH.with_module(nn.Linear, "fp32")):
        got = call(module)
    torch.testing.assert_close(got, expected, **BITWISE)


@pytest.mark.slow  # torch.compile
@pytest.mark.skipif(not compiling.COMPILE_SUPPORTED, reason="compiling the engine needs 2.13")
@pytest.mark.parametrize("where", ["outside", "inside"])
def test_a_compiled_fp32_module_rule_casts_keyword_inputs_as_eager(where):
    torch.manual_seed(0)
    module, call = _attention()
    expected = _oracle(module, call)
    policy = _TORCH.with_module(nn.MultiheadAttention, "fp32")

    def inside():
        with amped.autocast("cpu", policy=policy):
            return call(module)

    fn = torch.compile(
        inside if where == "inside" else lambda: call(module), backend="aot_eager", fullgraph=True
    )
    outside = where == "outside"
    try:
        with amped.autocast("cpu", policy=policy) if outside else contextlib.nullcontext():
            got = fn()
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got, expected, **BITWISE)
