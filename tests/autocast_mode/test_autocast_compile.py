"""amped's engine under torch.compile: compiled results and gradients equal eager ones.

Each policy kind runs a tiny model's forward and backward eagerly and compiled, with the
region opened outside the compiled function and inside it, always ``fullgraph=True``
(torch.autocast compiles fullgraph on CPU, and so must amped). ``aot_eager`` runs the
traced graph op by op, so it must match eager bitwise; inductor fuses and reorders, so
it gets a tolerance (INDUCTOR_* in tests/helpers/tolerances.py). Policy changes between calls
must recompile (Dynamo guards on the rules it read); recipes' training steps, GradScaler
included, run compiled the way torch's GradScaler does (a graph break at the one
host sync in ``step``) and match eager bitwise.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from recipes_helpers import batches, mlp
from tolerances import BITWISE, INDUCTOR_BF16
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

import amped
from amped.autocast_mode import compiling, current_path
from amped.autocast_mode.engine import forced_path
from amped.autocast_mode.mode import AutocastMode
from amped.autocast_mode.state import Path

pytestmark = pytest.mark.skipif(
    not compiling.COMPILE_SUPPORTED, reason="compiling amped's engine needs a newer torch"
)


@pytest.fixture(autouse=True)
def _no_graphs_left_behind():
    """Each test's graphs go with it (torch._dynamo.reset(): a later test starts as a
    process that compiled nothing)."""
    yield
    torch._dynamo.reset()


_TORCH = amped.Policy.preset("torch", "cpu")


@amped.autocast_op
def scaled_dot(q, k):
    return (q * k).sum(-1, keepdim=True) / q.shape[-1] ** 0.5


POLICIES = {
    "default": None,  # torch's C++ autocast does the casts: the control
    "changed-rule": _TORCH.with_ops(fp32=["linear"]),
    "module-rule-fp32": _TORCH.with_module(nn.LayerNorm, "fp32"),
    "module-rule-low": _TORCH.with_module(nn.LayerNorm, "low"),
    "strict": amped.Policy.preset("strict", "cpu"),
    "custom-op": _TORCH.with_ops(lower=[scaled_dot]),
}


class Net(nn.Module):
    """Linear, LayerNorm, GELU, Linear, softmax and a custom op: every path of the engine
    (listed op, rule differing from torch's, Python composite, module rule, custom op)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.norm, self.l2 = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.norm(self.l1(x)))
        y = self.l2(h)
        return F.softmax(y, -1).float().sum() + scaled_dot(y, h[:, :8]).float().sum()


X = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


def forward_backward(policy, where: str, backend: str | None):
    """Output and gradients of one step; compiled with ``backend`` unless it is None."""
    torch.manual_seed(0)
    model = Net()

    def outside(x):
        return model(x)

    def inside(x):
        with amped.autocast("cpu", policy=policy):
            return model(x)

    fn = outside if where == "outside" else inside
    if backend is not None:
        torch._dynamo.reset()
        fn = torch.compile(fn, backend=backend, fullgraph=True)
    region = (
        amped.autocast("cpu", policy=policy) if where == "outside" else contextlib.nullcontext()
    )
    with region:
        out = fn(X)
    out.backward()
    return out.detach(), [p.grad for p in model.parameters()]


def assert_close(got, expected, tolerance):
    torch.testing.assert_close(got[0], expected[0], **tolerance)
    for g, e in zip(got[1], expected[1], strict=True):
        assert g is not None and g.dtype == e.dtype
        torch.testing.assert_close(g, e, **tolerance)


def attention(layer: str) -> nn.Module:
    torch.manual_seed(0)
    if layer == "encoder-layer":
        return nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    return nn.MultiheadAttention(16, 2, batch_first=True)


ATTENTION_POLICIES = {
    "default": None,  # torch.autocast's own fullgraph compile: the control
    "module-rule-fp32": _TORCH.with_module(nn.LayerNorm, "fp32"),
    # F.multi_head_attention_forward under an fp32 override: Tensor.unflatten (a
    # super()-forwarding method) runs with torch's autocast kept out.
    "module-rule-attention-fp32": _TORCH.with_module(nn.MultiheadAttention, "fp32"),
    "strict": amped.Policy.preset("strict", "cpu"),
}


def attention_step(layer: str, policy, where: str, backend: str | None):
    model = attention(layer)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))

    def run(x):
        out = model(x) if layer == "encoder-layer" else model(x, x, x)[0]
        return out.float().square().sum()

    def inside(x):
        with amped.autocast("cpu", policy=policy):
            return run(x)

    fn = run if where == "outside" else inside
    if backend is not None:
        torch._dynamo.reset()
        fn = torch.compile(fn, backend=backend, fullgraph=True)
    outer = amped.autocast("cpu", policy=policy) if where == "outside" else contextlib.nullcontext()
    with outer:
        out = fn(x)
    out.backward()
    return out.detach(), [p.grad for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("where", ["outside", "inside"])
@pytest.mark.parametrize("name", list(ATTENTION_POLICIES))
@pytest.mark.parametrize("layer", ["multihead-attention", "encoder-layer"])
def test_attention_layers_compile_fullgraph_like_torch_autocast(layer, name, where):
    """torch.autocast compiles nn.MultiheadAttention and nn.TransformerEncoderLayer
    fullgraph; the mode engine must too (F._in_projection_packed calls Tensor.unflatten,
    whose super() call Dynamo cannot inline)."""
    policy = ATTENTION_POLICIES[name]
    expected = attention_step(layer, policy, where, backend=None)
    assert_close(attention_step(layer, policy, where, backend="aot_eager"), expected, BITWISE)


def test_eager_backend_with_the_engine_forced_on_torch_rules():
    with forced_path(Path.MODE):
        expected = forward_backward(None, "outside", backend=None)
        got = forward_backward(None, "outside", backend="eager")
    assert_close(got, expected, BITWISE)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "where"), [("changed-rule", "outside"), ("module-rule-fp32", "inside")]
)
def test_inductor_within_bfloat16_rounding(name, where):
    policy = POLICIES[name]
    expected = forward_backward(policy, where, backend=None)
    assert_close(forward_backward(policy, where, backend="inductor"), expected, INDUCTOR_BF16)


@pytest.mark.parametrize("where", ["outside", "inside"])
@pytest.mark.parametrize("name", list(POLICIES))
def test_aot_eager_is_bitwise_eager_and_each_step_reuses_the_graph(name, where):
    # aot_eager runs the traced graph op by op: the first step's output and gradients
    # equal eager ones bitwise. And a training loop opens a new region each step: the
    # graph compiled at the first must serve every later one (hooks gone or filled
    # caches would be guard failures: a recompile each step, then eager after Dynamo's
    # recompile limit), also with an eager region (an evaluation pass) between steps. As
    # in a process that never compiled before: the compile itself moves the regions off
    # the fast path. (One compile serves both checks.)
    policy = POLICIES[name]
    expected = forward_backward(policy, where, backend=None)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, graphs = Net(), []

    def inside(x):
        with amped.autocast("cpu", policy=policy):
            return model(x)

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    fn = torch.compile(model if where == "outside" else inside, backend=backend, fullgraph=True)
    for step in range(4):
        region = amped.autocast("cpu", policy=policy)
        with region if where == "outside" else contextlib.nullcontext():
            out = fn(X)
        out.backward()
        if step == 0:
            first = out.detach(), [p.grad.clone() for p in model.parameters()]
        with torch.no_grad(), amped.autocast("cpu", policy=policy):
            model(X)  # eagerly
    assert len(graphs) == 1
    assert_close(first, expected, BITWISE)


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_autocast_op_rule_applies_in_the_graph(where):
    # Dynamo folds has_torch_function to False for plain tensors, mode or not: the
    # decorated function asks for the mode stack instead, so the rule reaches the graph.
    seen = []

    @amped.autocast_op
    def mul(a, b):
        seen.append((a.dtype, b.dtype))
        return a * b

    policy = _TORCH.with_ops(lower=[mul])
    a, b = torch.randn(4, 4), torch.randn(4, 4)

    def inside(a, b):
        with amped.autocast("cpu", policy=policy):
            return mul(a, b)

    with amped.autocast("cpu", policy=policy):
        eager = mul(a, b)
    torch._dynamo.reset()
    fn = torch.compile(mul if where == "outside" else inside, backend="aot_eager", fullgraph=True)
    with amped.autocast("cpu", policy=policy) if where == "outside" else contextlib.nullcontext():
        got = fn(a, b)
    assert eager.dtype == got.dtype == torch.bfloat16
    assert seen[-1] == (torch.bfloat16, torch.bfloat16)
    torch.testing.assert_close(got, eager, **BITWISE)


@pytest.mark.parametrize("kind", ["kernel", "autocast-op"])
def test_compile_under_a_mode_entered_in_the_region_keeps_the_stack_in_order(kind):
    # The compile moves the region onto the mode; it goes where the region would have
    # pushed it, below the user's mode, which then exits cleanly (it pops itself).
    class Passthrough(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    @amped.autocast_op
    def mul(a, b):
        return a @ b

    torch._dynamo.reset()
    policy = _TORCH.with_ops(fp32=["mm"]) if kind == "kernel" else _TORCH.with_ops(lower=[mul])
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    compiled = torch.compile(mul, backend="aot_eager")
    with amped.autocast("cpu", policy=policy):
        eager = mul(a, b)
        user = Passthrough()
        with user:
            got = compiled(a, b)
            assert [type(m) for m in _get_current_function_mode_stack()] == [
                AutocastMode,
                Passthrough,
            ]
        assert [type(m) for m in _get_current_function_mode_stack()] == [AutocastMode]
        assert current_path("cpu") is Path.MODE
    assert _get_current_function_mode_stack() == []
    torch.testing.assert_close(got, eager, **BITWISE)


@pytest.mark.parametrize(
    "inner",
    [_TORCH, _TORCH.with_ops(fp32=["mm"]), _TORCH.with_module(nn.LayerNorm, "fp32")],
    ids=["torch", "changed-rule", "module-rule"],
)
def test_region_inside_a_compiled_function_nested_in_one_outside_compiles_fullgraph(inner):
    # Opening the inner region refreshes the mode's policies while Dynamo traces: compared
    # by identity there (Policy.__eq__ is not traceable), not by equality.
    @amped.autocast_op
    def mul(a, b):
        return a @ b

    outer = _TORCH.with_ops(lower=[mul])
    a, b = torch.randn(8, 8), torch.randn(8, 8)

    def fn(a, b):
        with amped.autocast("cpu", policy=inner):
            return mul(a, b) + torch.mm(a, b)

    with amped.autocast("cpu", policy=outer):
        eager = fn(a, b)
        torch._dynamo.reset()
        got = torch.compile(fn, backend="aot_eager", fullgraph=True)(a, b)
    torch.testing.assert_close(got, eager, **BITWISE)


def test_policy_change_between_calls_recompiles():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fn = torch.compile(lambda x, y: torch.mm(x, y), backend=backend, fullgraph=True)
    seen = []
    for policy in (_TORCH.with_ops(fp32=["mm"]), _TORCH.with_ops(keep=["mm"]), None):
        with amped.autocast("cpu", policy=policy):
            seen.append((fn(a.half(), b.half()).dtype, len(graphs)))
    with amped.autocast("cpu", policy=_TORCH.with_ops(fp32=["mm"])):  # an equal policy:
        seen.append((fn(a.half(), b.half()).dtype, len(graphs)))  # the first graph again
    assert seen == [
        (torch.float32, 1),
        (torch.float16, 2),
        (torch.bfloat16, 3),
        (torch.float32, 3),
    ]


def test_compiled_backward_is_traced_without_autocast_while_the_engine_is_on():
    config = torch._functorch.config
    before = config.backward_pass_autocast
    with amped.autocast("cpu", policy=POLICIES["changed-rule"]):
        assert current_path("cpu") is Path.KERNELS  # no mode: a compile would move it there
        assert config.backward_pass_autocast == before
    with amped.autocast("cpu", policy=POLICIES["module-rule-low"]):
        assert current_path("cpu") is Path.MODE
        assert config.backward_pass_autocast == "off"
        with amped.autocast("cpu", policy="strict"):
            assert config.backward_pass_autocast == "off"
        assert config.backward_pass_autocast == "off"
    assert config.backward_pass_autocast == before
    with amped.autocast("cpu"):  # torch's own autocast: torch's setting stays
        assert config.backward_pass_autocast == before


def test_older_torch_is_refused_with_a_clear_error(monkeypatch):
    monkeypatch.setattr(compiling, "COMPILE_SUPPORTED", False)
    torch._dynamo.reset()
    fn = torch.compile(lambda x: torch.mm(x, x), backend="eager", fullgraph=True)
    # Dynamo raises its Unsupported (a RuntimeError) carrying amped's message; without
    # fullgraph it would run the frame eagerly instead, where the engine needs nothing.
    region = amped.autocast("cpu", policy=POLICIES["changed-rule"])
    with region, pytest.raises(RuntimeError, match=r"needs torch >= 2\.13"):
        fn(torch.randn(2, 2))
    torch._dynamo.reset()


def train_steps(recipe: str, compiled: bool, inject_inf_at: int | None = None):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    setup = amped.prepare(model, opt, recipe=recipe)

    def step(x, y):
        with setup.autocast():
            loss = F.cross_entropy(setup.model(x), y)
        setup.backward(loss)
        setup.step()
        setup.zero_grad()
        return loss.detach()

    if compiled:
        torch._dynamo.reset()
        step = torch.compile(step, backend="aot_eager")
    losses = []
    for i, (x, y) in enumerate(batches(4)):
        if i == inject_inf_at:
            x = x.clone()
            x[0, 0] = float("inf")
        losses.append(step(x, y).float())
    params = [p.detach().clone() for p in setup.model.parameters()]
    return torch.stack(losses), params, setup


@pytest.mark.slow  # 5-10 s each: a recipe's whole step compiled
@pytest.mark.parametrize(
    ("recipe", "inject"),
    [("bf16-master", None), ("bf16-pure", None), ("fp16-mixed", 1), ("fp16-master", 2)],
)
def test_recipe_training_step_compiled_equals_eager(recipe, inject):
    e_losses, e_params, e_setup = train_steps(recipe, compiled=False, inject_inf_at=inject)
    c_losses, c_params, c_setup = train_steps(recipe, compiled=True, inject_inf_at=inject)
    torch.testing.assert_close(c_losses, e_losses, **BITWISE)
    for c, e in zip(c_params, e_params, strict=True):
        torch.testing.assert_close(c, e, **BITWISE)
    if inject is not None:  # one skipped step: the scale backed off once, exactly
        assert c_setup.scaler.get_scale() == e_setup.scaler.get_scale() == 65536.0 * 0.5
        assert not torch.isfinite(c_losses[inject])


_FIRST_USE = """
import torch, torch.nn.functional as F, amped
policy = amped.Policy.preset("torch", "cpu").with_module(torch.nn.LayerNorm, "fp32")
norm = torch.nn.LayerNorm(16)

def step(x):
    with amped.autocast("cpu", policy=policy):
        return F.relu(torch.mm(norm(x), x.t()))

x = torch.randn(4, 16)
compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(x)
with amped.autocast_mode.engine.forced_path(amped.autocast_mode.Path.MODE):
    eager = step(x)
assert compiled.dtype == eager.dtype == torch.bfloat16, (compiled.dtype, eager.dtype)
assert torch.equal(compiled, eager)
print("ok")
"""


@pytest.mark.slow
def test_first_region_of_a_process_compiles_fullgraph():
    """No region was opened eagerly before: what the engine needs is built when the
    policy is made, not on the first region (Dynamo cannot trace building it)."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", _FIRST_USE], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]
