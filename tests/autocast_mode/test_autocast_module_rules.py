"""Module rules as module hooks, checked against torch.

An ``"fp32"`` rule runs the module as ``torch.amp.custom_fwd(cast_inputs=torch.float32)``
runs a function: autocast off inside, floating inputs cast to float32 on entry; a
``"skip"`` rule turns autocast off inside. So the oracle is ``torch.autocast`` with the
ruled modules' ``forward`` wrapped that way, bitwise: loss and every gradient, on real
models, under both low dtypes. ``"low"`` rules (which need the mode) and policies that
change op rules too are checked against the same policy on the forced ``MODE`` path.
"""

from __future__ import annotations

import contextlib
import types

import model_zoo
import pytest
import torch
import torch.nn as nn
from tolerances import BITWISE

import amped
from amped.autocast_mode import compiling, current_path
from amped.autocast_mode.engine import forced_path
from amped.autocast_mode.state import Path

_TORCH = amped.Policy.preset("torch", "cpu")
# id -> (module class, precision): rules torch can express with custom_fwd
TORCH_EXPRESSIBLE = {
    "layernorm-fp32": (nn.LayerNorm, "fp32"),
    "attention-fp32": (nn.MultiheadAttention, "fp32"),
    "batchnorm-fp32": (nn.BatchNorm2d, "fp32"),
    "linear-skip": (nn.Linear, "skip"),
}
MODELS = {
    "transformer_encoder": model_zoo.transformer_encoder,
    "multihead_attention": model_zoo.multihead_attention,
    "cnn": model_zoo.cnn,
}


def _custom_fwd(module: nn.Module, precision: str) -> None:
    """Wrap ``module.forward`` as torch's custom_fwd would (the oracle)."""
    forward = module.forward

    def wrapped(*args, **kwargs):
        if not torch.is_autocast_enabled("cpu"):
            return forward(*args, **kwargs)
        if precision == "fp32":
            args = tuple(
                a.float()
                if isinstance(a, torch.Tensor)
                and a.is_floating_point()
                and a.dtype != torch.float64
                else a
                for a in args
            )
        with torch.autocast("cpu", enabled=False):
            return forward(*args, **kwargs)

    module.forward = wrapped


def _step(model, run, region):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # the same dropout masks on both sides
    with region:
        loss = run(model)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach().clone(), grads


def _assert_same(got, expected):
    (loss, grads), (expected_loss, expected_grads) = got, expected
    assert loss.dtype == expected_loss.dtype
    torch.testing.assert_close(loss, expected_loss, **BITWISE)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], **BITWISE, msg=f"grad of {name}")


def _assert_equals_torch(factory, cls, precision, dtype):
    torch.manual_seed(0)
    model, run = factory()
    policy = _TORCH.with_module(cls, precision)
    region = amped.autocast("cpu", dtype, policy=policy)
    try:
        got = _step(model, run, region)
    except RuntimeError as error:  # (a skip rule on a module fed low precision): fail alike
        for m in model.modules():
            if isinstance(m, cls):
                _custom_fwd(m, precision)
        with pytest.raises(RuntimeError, match=str(error)[:40]):
            _step(model, run, torch.autocast("cpu", dtype=dtype))
        return
    for m in model.modules():
        if isinstance(m, cls):
            _custom_fwd(m, precision)
    _assert_same(got, _step(model, run, torch.autocast("cpu", dtype=dtype)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rule", list(TORCH_EXPRESSIBLE), ids=list(TORCH_EXPRESSIBLE))
@pytest.mark.parametrize("name", list(MODELS), ids=list(MODELS))
def test_module_rule_equals_torch_with_custom_fwd(name, rule, dtype):
    _assert_equals_torch(MODELS[name], *TORCH_EXPRESSIBLE[rule], dtype)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_layernorm_fp32_equals_torch_with_custom_fwd_on_transformers(name, attn):
    pytest.importorskip("transformers")
    factory = model_zoo.TRANSFORMERS[name]

    def train_factory():
        model, run = factory(attn)
        model.train()
        return model, run

    _assert_equals_torch(train_factory, nn.LayerNorm, "fp32", torch.bfloat16)


MODE_CHECKED = {
    "layernorm-low": _TORCH.with_module(nn.LayerNorm, "low"),
    "linear-low": _TORCH.with_module(nn.Linear, "low"),
    "layernorm-fp32+softmax-fp32": _TORCH.with_module(nn.LayerNorm, "fp32").with_ops(
        fp32=["softmax", "bmm", "baddbmm", "scaled_dot_product_attention"]
    ),
    "layernorm-fp32": _TORCH.with_module(nn.LayerNorm, "fp32"),
}


@pytest.mark.parametrize("rule", list(MODE_CHECKED), ids=list(MODE_CHECKED))
@pytest.mark.parametrize("name", list(MODELS), ids=list(MODELS))
def test_each_path_equals_the_mode(name, rule):
    torch.manual_seed(0)
    model, run = MODELS[name]()
    policy = MODE_CHECKED[rule]
    try:
        got = _step(model, run, amped.autocast("cpu", policy=policy))
    except RuntimeError as error:
        with pytest.raises(RuntimeError, match=str(error)[:40]), forced_path(Path.MODE):
            _step(model, run, amped.autocast("cpu", policy=policy))
        return
    with forced_path(Path.MODE):
        _assert_same(got, _step(model, run, amped.autocast("cpu", policy=policy)))


def test_the_one_changed_case_a_low_precision_tensor_not_passed_as_input():
    """Changed with module hooks: inside an ``"fp32"`` module autocast is off, so a
    low-precision tensor that reaches it other than through its inputs (an attribute
    set outside) is no longer cast up by the op that uses it, as under torch's
    ``custom_fwd``: a matmul of float32 and bfloat16 raises. Pass it as an input (it is
    then cast), or cast it in the module."""

    class Mixes(nn.Module):
        def __init__(self):
            super().__init__()
            self.side: torch.Tensor | None = None

        def forward(self, x, y=None):
            return x @ (self.side if y is None else y)

    m, x = Mixes(), torch.randn(4, 4)
    policy = _TORCH.with_module(Mixes, "fp32")
    with amped.autocast("cpu", policy=policy):
        m.side = torch.randn(4, 4).bfloat16()
        with pytest.raises(RuntimeError, match="dtype"):
            m(x)
        assert m(x, m.side).dtype == torch.float32  # through its inputs: cast up
        assert m(x, m.side.float()).dtype == torch.float32


@pytest.mark.parametrize("forced", [False, True], ids=["torch-path", "mode-path"])
def test_fp32_module_rule_casts_nothing_where_autocast_is_off(forced):
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

    def context():
        return forced_path(Path.MODE) if forced else contextlib.nullcontext()

    with context(), amped.autocast("cpu", policy=policy):
        eager, compiled = block(x)
        with torch.autocast("cpu", enabled=False):
            nested = block.norm(x)
    assert eager.dtype == compiled.dtype == nested.dtype == torch.bfloat16
    torch.testing.assert_close(compiled, eager, **BITWISE)
    with context(), amped.autocast("cpu", policy=_TORCH.with_module(nn.LayerNorm, "fp32")):
        assert block.norm(x).dtype == torch.float32  # autocast on: the rule applies
    torch._dynamo.reset()


@pytest.mark.skipif(
    not compiling.COMPILE_SUPPORTED, reason="compiling amped's engine needs a newer torch"
)
def test_after_a_compile_module_rules_reuse_their_graph():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 4))
    x = torch.randn(3, 8)
    graphs = []
    compiled = torch.compile(model, backend=lambda gm, inputs: graphs.append(gm) or gm.forward)
    policy = _TORCH.with_module(nn.LayerNorm, "fp32")
    for _ in range(3):  # each step a new region (new hooks would be a new graph)
        with amped.autocast("cpu", policy=policy):
            got = compiled(x)
            assert current_path("cpu") is Path.MODE  # a traced policy: the mode
            eager = model(x)
        torch.testing.assert_close(got, eager, **BITWISE)
    assert len(graphs) == 1 and got.dtype == torch.bfloat16
    torch._dynamo.reset()


def test_a_name_rule_picks_one_module_of_its_class_region_after_region():
    # A rule that selects by qualified name runs one Linear among others of its class
    # (so no answer per class may be kept), on two models in turn under one policy.
    policy = _TORCH.with_module("1", "fp32")
    for n in (3, 4):
        torch.manual_seed(0)
        model, x = nn.Sequential(*[nn.Linear(8, 8) for _ in range(n)]), torch.randn(2, 8)

        def run(m, x=x):
            return m(x).float().sum()

        got = _step(model, run, amped.autocast("cpu", policy=policy))
        unruled = _step(model, run, torch.autocast("cpu"))
        _custom_fwd(model[1], "fp32")
        _assert_same(got, _step(model, run, torch.autocast("cpu")))
        assert not torch.equal(got[0], unruled[0])  # the rule changed the result


class _PairNorm(nn.LayerNorm):
    """A norm layer taking its input nested in a pair, and a keyword tensor: records the
    dtypes it received."""

    def forward(self, pair, *, shift=None):
        self.seen = [pair[0].dtype, pair[1].dtype, None if shift is None else shift.dtype]
        return super().forward(pair[0] + pair[1] + (0 if shift is None else shift))


def test_fp32_modules_cast_nested_inputs_as_custom_fwd_under_both_rules():
    """One float32 rule: the policy's ``"fp32"`` module rule and the O2 recipes' norm
    hooks give a module its nested and keyword inputs in float32, as ``custom_fwd``
    would (tests/autocast_mode/test_float32_modules.py has more)."""

    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def oracle(ctx, pair, *, shift=None):  # (custom_fwd decorates a Function's forward)
        return [pair[0].dtype, pair[1].dtype, None if shift is None else shift.dtype]

    ctx = types.SimpleNamespace()

    x = torch.randn(2, 8).bfloat16()
    pair = (x, [x][0])
    norm = _PairNorm(8)
    with amped.autocast("cpu", policy=_TORCH.with_module(_PairNorm, "fp32")):
        norm(pair, shift=x)
        with torch.autocast("cpu"):
            expected = oracle(ctx, pair, shift=x)
    assert norm.seen == expected == [torch.float32] * 3

    model = nn.Sequential(nn.Linear(8, 8))
    model.append(_PairNorm(8))
    setup = amped.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16-master")
    with setup.autocast():
        model[1](pair, shift=x)
        with torch.autocast("cpu"):
            expected = oracle(ctx, pair, shift=x)
    assert model[1].seen == expected == [torch.float32] * 3
