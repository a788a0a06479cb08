"""The lean mode: a mode-engine region that leaves torch's own rules to torch's C++ autocast.

A policy that needs the mode engine for module rules (the bf16-master / fp16-master
recipes keep norms in float32 that way) has torch's op rules everywhere else. In an
eager region whose mode has no other mode below it, the mode then looks up only the
rules torch's C++ autocast cannot apply (none, for a module-rule-only policy) and runs
torch's Python composites (``F.multi_head_attention_forward``) without the transparent
re-entry; inside a module the rule names, the full tables are in force. With no rule
left, the mode is *parked* off the torch-function stack, and the module rules' hooks
push it for just the modules a rule names. The oracle is the full mode engine
(``state.FAST_PATH`` off), bitwise: outputs and every gradient.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

import amped
import model_zoo
from amped.autocast_mode import compiling, dispatch, freshness, state
from amped.autocast_mode.mode import AutocastMode
from tolerances import BITWISE

_TORCH = amped.Policy.preset("torch", "cpu")
MODULE_RULES = {
    "layernorm-fp32": _TORCH.with_module(nn.LayerNorm, "fp32"),
    "layernorm-low": _TORCH.with_module(nn.LayerNorm, "low"),
    "attention-fp32": _TORCH.with_module(nn.MultiheadAttention, "fp32"),
    "linear-low": _TORCH.with_module(nn.Linear, "low"),
    "batchnorm-fp32": _TORCH.with_module(nn.BatchNorm2d, "fp32"),
    "linear-skip": _TORCH.with_module(nn.Linear, "skip"),
    # an op rule that differs from torch's: the lean table keeps it, composites re-enter
    "layernorm-fp32+softmax-fp32": _TORCH.with_module(nn.LayerNorm, "fp32").with_ops(
        fp32=["softmax", "bmm", "baddbmm", "scaled_dot_product_attention"]
    ),
}


@pytest.fixture(autouse=True)
def eager_process(monkeypatch):
    """As in a process that has not compiled (an earlier test file may have)."""
    dispatch.watch_compiles()  # listening (an earlier test may have reset Dynamo)
    monkeypatch.setattr(dispatch, "compiled_once", False)


def _step(model, run, policy, *, lean):
    state.FAST_PATH = lean  # off: the full mode engine, the oracle
    try:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)  # the same dropout masks on both sides
        with amped.autocast("cpu", policy=policy):
            assert state._state.mode is not None and state._state.mode.lean is lean
            loss = run(model)
    finally:
        state.FAST_PATH = True
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach().clone(), grads


def _assert_bitwise(model, run, policy):
    try:
        expected_loss, expected = _step(model, run, policy, lean=False)
    except RuntimeError as error:  # (a skip rule on a module fed bfloat16): fail alike
        with pytest.raises(RuntimeError, match=str(error)[:40]):
            _step(model, run, policy, lean=True)
        return
    loss, grads = _step(model, run, policy, lean=True)
    assert loss.dtype == expected_loss.dtype
    torch.testing.assert_close(loss, expected_loss, **BITWISE)
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], **BITWISE, msg=f"grad of {name}")


MODELS = {
    "transformer_encoder": model_zoo.transformer_encoder,
    "multihead_attention": model_zoo.multihead_attention,
    "cnn": model_zoo.cnn,
}


@pytest.mark.parametrize("rule", list(MODULE_RULES), ids=list(MODULE_RULES))
@pytest.mark.parametrize("name", list(MODELS), ids=list(MODELS))
def test_lean_mode_bitwise_equal_to_full_engine_on_torch_nn(name, rule):
    torch.manual_seed(0)
    model, run = MODELS[name]()
    _assert_bitwise(model, run, MODULE_RULES[rule])


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_lean_mode_bitwise_equal_to_full_engine_on_transformers(name, attn):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, run = model_zoo.TRANSFORMERS[name](attn)
    model.train()
    for rule in ("layernorm-fp32", "linear-low", "layernorm-fp32+softmax-fp32"):
        _assert_bitwise(model, run, MODULE_RULES[rule])


def test_need_weights_attention_with_a_changed_rule_inside_the_composite():
    # MultiheadAttention with need_weights=True runs softmax inside the Python composite:
    # the changed rule must reach it in the lean mode too (it re-enters composites).
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4)
    x = torch.randn(5, 2, 16)
    policy = MODULE_RULES["layernorm-fp32+softmax-fp32"]

    def run(m):
        out, weights = m(x, x, x, need_weights=True)
        assert weights.dtype == torch.float32  # softmax in float32, as the policy says
        return out.float().sum() + weights.sum()

    _assert_bitwise(mha, run, policy)


def test_which_regions_run_lean(monkeypatch):
    module_rule = MODULE_RULES["layernorm-fp32"]
    with amped.autocast("cpu", policy=module_rule):
        mode = state._state.mode
        assert mode.lean and mode.rules == {} and not mode.reenter
        assert mode.parkable and not on_stack()
    with amped.autocast("cpu", policy=MODULE_RULES["layernorm-fp32+softmax-fp32"]):
        mode = state._state.mode
        assert mode.lean and mode.reenter and not mode.parkable and on_stack()
        assert torch.softmax in mode.rules and torch._C._nn.linear not in mode.rules
    with state.engine_always(), amped.autocast("cpu", policy=module_rule):
        assert not state._state.mode.lean  # the doctor's path: amped makes every cast
    with TorchFunctionMode(), amped.autocast("cpu", policy=module_rule):
        assert not state._state.mode.lean  # a mode below must see amped's casts
    with amped.autocast("cpu", policy=module_rule):
        with state.engine_always(), amped.autocast("cpu"):
            assert not state._state.mode.lean and on_stack()  # a forced region: full
        assert state._state.mode.lean and not on_stack()
    monkeypatch.setattr(state, "FAST_PATH", False)
    with amped.autocast("cpu", policy=module_rule):
        assert not state._state.mode.lean


def on_stack() -> bool:
    """Whether amped's mode is on this thread's torch-function stack."""
    found = any(isinstance(m, AutocastMode) for m in _get_current_function_mode_stack())
    mode = state._state.mode
    assert found == (mode is not None and mode.on_stack)
    return found


class Probe(nn.LayerNorm):
    """A LayerNorm that records, when called, what the engine's mode holds."""

    def __init__(self, size, seen, inner=None):
        super().__init__(size)
        self.seen, self.inner = seen, inner

    def forward(self, x):
        mode = state._state.mode
        self.seen.append((on_stack(), mode.rules is mode.full_rules, mode.reenter))
        if self.inner is not None:
            x = self.inner(x)
        return super().forward(x)


def test_inside_a_ruled_module_the_full_tables_apply():
    seen: list = []
    inner = nn.Sequential(nn.Linear(4, 4), Probe(4, seen))  # a ruled module inside one
    model = nn.Sequential(nn.Linear(4, 4), Probe(4, seen, inner), nn.Linear(4, 4))
    with amped.autocast("cpu", policy=MODULE_RULES["layernorm-fp32"]):
        assert not on_stack()
        out = model(torch.randn(2, 4))
        mode = state._state.mode
        assert mode.rules == {} and not mode.reenter and not on_stack()  # parked again
    assert seen == [(True, True, True), (True, True, True)]
    assert out.dtype == torch.bfloat16


def test_a_ruled_module_that_raises_parks_the_mode_again():
    class Boom(nn.LayerNorm):
        def forward(self, x):
            assert on_stack()
            raise ValueError("boom")

    with amped.autocast("cpu", policy=MODULE_RULES["layernorm-fp32"]):
        with pytest.raises(ValueError, match="boom"):
            Boom(4)(torch.randn(2, 4))
        assert not on_stack() and state._state.mode.override is None
        assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.bfloat16
    assert not on_stack()


def test_regions_nested_in_a_parked_one():
    a = torch.randn(4, 4)
    changed = _TORCH.with_ops(fp32=["mm"])  # the kernels' alone; under an open mode, its
    seen: list = []

    class Opens(nn.LayerNorm):  # a region opened inside a ruled module
        def forward(self, x):
            with amped.autocast("cpu"):
                seen.append(on_stack())
            seen.append(on_stack())
            return super().forward(x)

    with amped.autocast("cpu", policy=MODULE_RULES["layernorm-fp32"]):
        with amped.autocast("cpu", policy=changed):
            assert on_stack() and torch.mm(a, a).dtype == torch.float32  # the mode rules
        assert not on_stack() and torch.mm(a, a).dtype == torch.bfloat16
        Opens(4)(torch.randn(2, 4))
        assert seen == [True, True] and not on_stack()
    assert not on_stack()


def test_compile_start_unparks_a_lean_mode(monkeypatch):
    # Dynamo guards on the mode stack: from the compile on, the mode stays on it (the
    # graph traced with it is then reused by later regions); module rules keep it lean.
    with amped.autocast("cpu", policy=MODULE_RULES["layernorm-fp32"]):
        assert state._state.mode.lean and not on_stack()
        dispatch._on_compile_start(None)  # what torch.compile's start callback runs
        assert dispatch.compiled_once
        mode = state._state.mode
        assert mode.lean and mode.rules is mode.lean_rules and not mode.parkable
        assert on_stack()
    with amped.autocast("cpu", policy=MODULE_RULES["layernorm-fp32"]):
        assert state._state.mode.lean and on_stack()  # and so is every later region
    changed = amped.Policy.preset("torch", "cpu").with_ops(fp32=["mm"])
    with amped.autocast("cpu", policy=changed):  # no module rules: the full mode
        assert not state._state.regions[-1].fast and not state._state.mode.lean


@pytest.mark.skipif(
    not compiling.COMPILE_SUPPORTED, reason="compiling amped's engine needs a newer torch"
)
def test_after_a_compile_module_rules_stay_lean_and_reuse_their_graph():
    torch._dynamo.reset()
    dispatch.watch_compiles()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 4))
    x = torch.randn(3, 8)
    graphs = []
    compiled = torch.compile(model, backend=lambda gm, inputs: graphs.append(gm) or gm.forward)
    policy = MODULE_RULES["layernorm-fp32"]
    for _ in range(3):  # each step a new region (new hooks would be a new graph)
        with amped.autocast("cpu", policy=policy):
            got = compiled(x)
            assert state._state.mode.lean and on_stack()
            eager = model(x)  # the same region, eagerly: the lean mode, unparked
        torch.testing.assert_close(got, eager, **BITWISE)
    assert len(graphs) == 1 and dispatch.compiled_once and got.dtype == torch.bfloat16


def test_lean_mode_casts_a_weight_changed_in_place_again(monkeypatch):
    # torch's cache serves torch's own rules in the lean mode; the module rules' hook
    # drops it when a called module's parameter moved, so the new weight is cast.
    x = torch.randn(3, 8)
    policy = MODULE_RULES["layernorm-fp32"]

    def run(*, lean):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))
        state.FAST_PATH = lean
        try:
            with amped.autocast("cpu", policy=policy):
                assert state._state.mode.lean is lean
                first = m(x)
                with torch.no_grad():
                    m[0].weight.copy_(torch.ones_like(m[0].weight))
                return first.detach(), m(x)
        finally:
            state.FAST_PATH = True

    full = run(lean=False)  # the full engine casts again (tests/test_autocast_cache.py)
    for got, expected in zip(run(lean=True), full, strict=True):
        torch.testing.assert_close(got, expected, **BITWISE)
    monkeypatch.setattr(freshness, "check", lambda module: None)  # control: no hook
    assert not torch.equal(run(lean=True)[1], full[1])  # torch's cache: the stale cast


@pytest.mark.parametrize("engine", ["lean", "full"])
def test_fp32_module_rule_casts_nothing_where_autocast_is_off(engine):
    # A module rule applies where autocast is on, as op rules do (and as torch's
    # custom_fwd(cast_inputs=...)): under a "skip" rule around it, or a nested
    # autocast(enabled=False), an "fp32" module runs on its inputs as they are. So a
    # graph compiled outside any region, whose guards pass there, computes the same.
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(8)
            self.run = torch.compile(self.norm, backend="eager")

        def forward(self, x):
            return self.norm(x), self.run(x)

    torch.manual_seed(0)
    block, x = Block(), torch.randn(4, 8).to(torch.bfloat16)
    block(x)  # compiled outside any region, with autocast off
    policy = _TORCH.with_module(Block, "skip").with_module(nn.LayerNorm, "fp32")

    def forced():
        return state.engine_always() if engine == "full" else contextlib.nullcontext()

    with forced(), amped.autocast("cpu", policy=policy):
        eager, compiled = block(x)
        with torch.autocast("cpu", enabled=False):
            nested = block.norm(x)
    assert eager.dtype == compiled.dtype == nested.dtype == torch.bfloat16
    torch.testing.assert_close(compiled, eager, **BITWISE)
    with forced(), amped.autocast("cpu", policy=_TORCH.with_module(nn.LayerNorm, "fp32")):
        assert block.norm(x).dtype == torch.float32  # autocast on: the rule applies
