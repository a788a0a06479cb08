"""The fast path: a policy's changed op rules as kernels at torch's Autocast keys.

Checked against the mode engine (the same policy on the forced ``MODE`` path) on every entry
of torch's CPU autocast test lists, bitwise; against torch for plain ``torch.autocast``
while the kernels are registered; and for the weight cache, undoing the registration,
thread isolation and ``torch.compile``.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from test_autocast_op_lists import LOW_DTYPES, _assert_same, _cpu_cases, _run, _variants
from tolerances import BITWISE

import amped
from amped.autocast_mode import compiling, current_path, dispatch
from amped.autocast_mode.engine import forced_path
from amped.autocast_mode.state import Path
from amped.policy import Cast
from amped.policy.ops import torch_default_rules

_TORCH = amped.Policy.preset("torch", "cpu")
_SWAP = {Cast.LOWER: "fp32", Cast.FP32: "lower"}
# Every rule torch has on CPU turned around: low-precision ops to fp32 and back.
SWAPPED = _TORCH.with_ops(
    fp32=[op for op, c in torch_default_rules("cpu").items() if c is Cast.LOWER],
    lower=[op for op, c in torch_default_rules("cpu").items() if c is Cast.FP32],
)
POLICIES = {"strict": amped.Policy.preset("strict", "cpu"), "swapped": SWAPPED}


def on_mode():
    return forced_path(Path.MODE)


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
def test_op_lists_bitwise_equal_to_mode_engine(name, dtype):
    policy = POLICIES[name]
    with amped.autocast("cpu", dtype, policy=policy):
        assert current_path("cpu") is Path.KERNELS
    for list_name, op, args, kwargs in _cpu_cases():
        for label, fn, call_args in _variants(list_name, op, args):
            with on_mode():
                engine = _run(fn, call_args, kwargs, amped.autocast("cpu", dtype, policy=policy))
            fast = _run(fn, call_args, kwargs, amped.autocast("cpu", dtype, policy=policy))
            _assert_same(engine, fast, f"{name}: {label} under {dtype}")


def test_fast_path_runs_no_mode_and_registers_only_changed_ops():
    dispatch.release_kernels()
    policy = _TORCH.with_ops(fp32=["mm"])
    with amped.autocast("cpu", policy=policy):
        assert torch._C._len_torch_function_stack() == 0
        assert current_path("cpu") is Path.KERNELS
        assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.float32
        assert torch.matmul(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.bfloat16
    names = {name for name, _ in dispatch.registered_ops()}
    assert "aten::mm" in names and "aten::matmul" not in names


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
def test_torch_autocast_unchanged_while_kernels_registered(dtype):
    # Register every kernel both policies need, then plain torch.autocast must give
    # what it gives with none registered.
    for policy in POLICIES.values():
        with amped.autocast("cpu", policy=policy):
            pass
    assert dispatch.registered_ops()
    with_kernels = []
    cases = [
        (fn, a, kw) for ln, op, args, kw in _cpu_cases() for _, fn, a in _variants(ln, op, args)
    ]
    for fn, args, kwargs in cases:
        with_kernels.append(_run(fn, args, kwargs, torch.autocast("cpu", dtype=dtype)))
    dispatch.release_kernels()
    assert dispatch.registered_ops() == []
    for (fn, args, kwargs), got in zip(cases, with_kernels, strict=True):
        _assert_same(_run(fn, args, kwargs, torch.autocast("cpu", dtype=dtype)), got, str(fn))


def test_release_restores_torch_kernels_and_registration_is_lazy():
    dispatch.release_kernels()
    with torch.autocast("cpu"):
        torch.mm(torch.randn(2, 2), torch.randn(2, 2))
    with amped.autocast("cpu"):  # the default policy registers nothing
        pass
    assert dispatch.registered_ops() == []
    with amped.autocast("cpu", policy=_TORCH.with_ops(fp32=["mm"])):
        assert dispatch.registered_ops() == [
            ("aten::mm", "AutocastCPU"),
            ("aten::mm.dtype", "AutocastCPU"),
        ]
        with pytest.raises(RuntimeError, match="Close the region first"):
            dispatch.release_kernels()
    dispatch.release_kernels()
    assert "autocast_mode.cpp" in repr(torch.library.get_kernel("aten::mm", "AutocastCPU"))


class _Loss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(3, 4))

    def forward(self, x):
        return F.l1_loss(x, self.weight, reduction="none")


LOW_LOSS = _TORCH.with_ops(lower=["l1_loss"])  # torch runs it in fp32: amped's kernel casts


def test_kernels_keep_gradients_after_no_grad_and_match_the_mode():
    def run():
        torch.manual_seed(0)
        m, x = _Loss(), torch.randn(3, 4)
        with amped.autocast("cpu", policy=LOW_LOSS):
            path = current_path("cpu")
            with torch.no_grad():
                m(x)
            out = m(x)
            with torch.no_grad():
                m.weight.mul_(3.0)
            stale = m(x)  # the weight's cast is served until the region closes
        (out.float().sum() + stale.float().sum()).backward()
        return path, out, stale, m.weight.grad

    path, *fast = run()
    assert path is Path.KERNELS and fast[0].dtype == torch.bfloat16 and fast[0].requires_grad
    assert torch.equal(fast[0], fast[1]) and fast[2] is not None
    with on_mode():
        path, *engine = run()
    assert path is Path.MODE
    for a, b in zip(fast, engine, strict=True):
        assert torch.equal(a, b)


def test_gradients_bitwise_equal_to_engine():
    def run():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16))
        x = torch.randn(4, 8)
        with amped.autocast("cpu", policy=POLICIES["strict"]):
            loss = F.log_softmax(model(x), -1).pow(2).sum()
        loss.backward()
        return [loss, *(p.grad for p in model.parameters())]

    fast = run()
    with on_mode():
        engine = run()
    for a, b in zip(fast, engine, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_threads_are_isolated():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    inside, other = threading.Barrier(2), {}

    def plain():
        inside.wait()
        with torch.autocast("cpu"):
            other["dtype"] = torch.mm(a, b).dtype
        inside.wait()

    worker = threading.Thread(target=plain)
    worker.start()
    with amped.autocast("cpu", policy=_TORCH.with_ops(fp32=["mm"])):
        inside.wait()
        inside.wait()
        assert torch.mm(a, b).dtype == torch.float32
    worker.join()
    assert other["dtype"] == torch.bfloat16


def test_compile_switches_the_region_to_the_engine_and_guards():
    torch._dynamo.reset()

    def f(a, b):
        return torch.mm(a, b)

    compiled = torch.compile(f, backend="aot_eager")
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    policy = _TORCH.with_ops(fp32=["mm"])
    with amped.autocast("cpu", policy=policy):
        assert current_path("cpu") is Path.KERNELS
        got = compiled(a, b)  # compiling: the region moves to the mode engine
        assert current_path("cpu") is Path.MODE
        assert got.dtype == torch.float32 and torch.equal(got, f(a, b))
    with torch.autocast("cpu"):  # the graph is not reused for plain torch.autocast
        assert compiled(a, b).dtype == torch.bfloat16
    with amped.autocast("cpu", policy=policy):  # a traced policy: the mode, graph reused
        assert current_path("cpu") is Path.MODE
        assert compiled(a, b).dtype == torch.float32
    torch._dynamo.reset()


@pytest.mark.skipif(
    not compiling.COMPILE_SUPPORTED, reason="compiling amped's engine needs a newer torch"
)
def test_compile_on_one_thread_leaves_another_threads_path():
    # A compile records the policies it traced for its own thread only: an eager region
    # of the same policy on a new thread keeps its path, and that thread calling the
    # compiled function compiles once for itself (moving its region to the mode).
    torch._dynamo.reset()
    a = torch.randn(4, 4)
    compiled = torch.compile(lambda x: torch.mm(x, x), backend="aot_eager")
    policy = _TORCH.with_ops(fp32=["mm"])
    with amped.autocast("cpu", policy=policy):
        assert current_path("cpu") is Path.KERNELS
        expected = compiled(a)
        assert current_path("cpu") is Path.MODE
    seen = {}

    def other_thread():
        with amped.autocast("cpu", policy=policy):
            seen["eager"] = (current_path("cpu"), torch.mm(a, a))
        with amped.autocast("cpu", policy=policy):
            seen["compiled"] = compiled(a)
            seen["after"] = current_path("cpu")
        with amped.autocast("cpu", policy=policy):
            seen["next"] = current_path("cpu")

    worker = threading.Thread(target=other_thread)
    worker.start()
    worker.join()
    assert seen["eager"][0] is Path.KERNELS
    assert seen["eager"][1].dtype == torch.float32 and torch.equal(seen["eager"][1], expected)
    assert torch.equal(seen["compiled"], expected) and seen["compiled"].dtype == torch.float32
    assert seen["after"] is Path.MODE and seen["next"] is Path.MODE
    with amped.autocast("cpu", policy=policy):  # this thread's record is unchanged
        assert current_path("cpu") is Path.MODE
    torch._dynamo.reset()


@pytest.mark.skipif(
    not compiling.COMPILE_SUPPORTED, reason="compiling amped's engine needs a newer torch"
)
def test_compile_isolation_unrelated_regions_keep_their_path():
    # A function compiled under autocast (torch's, the default policy's, another
    # policy's) changes nothing for an eager region of another policy: it runs its own
    # path, and the compiled function called there compiles again for it (Dynamo's
    # guards see amped's mark), never reusing a graph traced for other rules.
    torch._dynamo.reset()
    a = torch.randn(4, 4)
    compiled = torch.compile(lambda x: torch.mm(x, x), backend="aot_eager")
    with torch.autocast("cpu"):
        assert compiled(a).dtype == torch.bfloat16
    with amped.autocast("cpu"):
        assert compiled(a).dtype == torch.bfloat16
    with amped.autocast("cpu", policy=_TORCH.with_ops(fp32=["addmm"])):
        assert compiled(a).dtype == torch.bfloat16
    policy = _TORCH.with_ops(fp32=["mm"])
    with amped.autocast("cpu", policy=policy):
        assert current_path("cpu") is Path.KERNELS  # unrelated compiles: its normal path
        assert torch.mm(a, a).dtype == torch.float32
        assert compiled(a).dtype == torch.float32  # compiled again here, for its rules
        assert current_path("cpu") is Path.MODE
    with amped.autocast("cpu", policy=amped.Policy.preset("strict", "cpu")):
        assert current_path("cpu") is Path.KERNELS
    torch._dynamo.reset()


def test_compile_with_autocast_off_everywhere_leaves_the_fast_path():
    # A graph traced with autocast off on every device type is guarded on that state, so
    # it never runs inside a region: compiled outside any region (a compiled optimizer
    # step), it costs later regions nothing.
    torch._dynamo.reset()
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    helper = torch.compile(lambda x: torch.mm(x, x) * 2, backend="aot_eager")
    outside = helper(a)
    policy = _TORCH.with_ops(fp32=["mm"])
    with amped.autocast("cpu", policy=policy):
        assert current_path("cpu") is Path.KERNELS
        assert torch.mm(a, b).dtype == torch.float32
        got = helper(a)  # the guard on autocast fails: compiled again, inside the region
        assert current_path("cpu") is Path.MODE
    assert got.dtype == torch.float32 and torch.equal(got, outside)
    with amped.autocast("cpu", policy=policy):
        assert current_path("cpu") is Path.MODE  # the mode, so the graph is reused
    torch._dynamo.reset()


def test_compile_inside_a_region_with_autocast_disabled_compiles_once():
    # Inside a region, even with autocast switched off there, the compile switches the
    # region to the mode; later regions must run it too, or each step would recompile.
    torch._dynamo.reset()
    a = torch.randn(4, 4)
    compiles = []
    fn = torch.compile(
        lambda x: torch.mm(x, x),
        backend=lambda gm, inputs: compiles.append(gm) or gm.forward,
    )
    for _ in range(3):
        policy = _TORCH.with_ops(fp32=["mm"])
        with amped.autocast("cpu", policy=policy), torch.autocast("cpu", enabled=False):
            assert fn(a).dtype == torch.float32
    assert len(compiles) == 1
    torch._dynamo.reset()


def test_nested_regions_each_apply_their_own_rules():
    a = torch.randn(4, 4)
    changed = _TORCH.with_ops(fp32=["mm"])
    with amped.autocast("cpu", policy=changed):
        with amped.autocast("cpu"):  # torch's rules inside
            assert torch.mm(a, a).dtype == torch.bfloat16
        assert torch.mm(a, a).dtype == torch.float32
        with amped.autocast("cpu", policy=WITH_LOW_RULE):  # needs the mode: it takes over
            assert current_path("cpu") is Path.MODE
            assert torch.mm(a, a).dtype == torch.bfloat16
        assert current_path("cpu") is Path.KERNELS and torch.mm(a, a).dtype == torch.float32
    with amped.autocast("cpu"), amped.autocast("cpu", policy=changed):
        assert torch.mm(a, a).dtype == torch.float32


WITH_MODULE_RULE = _TORCH.with_module(torch.nn.LayerNorm, "fp32")
WITH_LOW_RULE = _TORCH.with_module(torch.nn.LayerNorm, "low")


@torch.library.custom_op("amped_dispatch_test::scaled", mutates_args=())
def _scaled(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x * w).sum(-1)


@_scaled.register_fake
def _(x, w):
    return x.new_empty(x.shape[:-1])


def _scaled_backward(ctx, grad):
    x, w = ctx.saved_tensors
    return grad[..., None] * w, (grad[..., None] * x).sum(0)


def _scaled_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


_scaled.register_autograd(_scaled_backward, setup_context=_scaled_setup)


def test_torch_library_custom_op_bitwise_equal_to_engine():
    policy = _TORCH.with_ops(lower=[_scaled])
    x, w = torch.randn(3, 4), torch.randn(4, requires_grad=True)

    def run():
        with amped.autocast("cpu", policy=policy):
            out = _scaled(x, w)
            path = current_path("cpu")
        out.float().sum().backward()
        grad, w.grad = w.grad, None
        return out, grad, path

    out, grad, path = run()
    assert path is Path.KERNELS and out.dtype == torch.bfloat16
    with on_mode():
        out2, grad2, path2 = run()
    assert path2 is Path.MODE and torch.equal(out, out2) and torch.equal(grad, grad2)


SCALAR_OPERANDS = {
    "float-tensor + float": (lambda: torch.randn(3), lambda x: x + 1e-6),
    "int-tensor * float": (lambda: torch.arange(3), lambda x: x * 0.5),  # -> float32
    "bf16-tensor - int": (lambda: torch.randn(3).bfloat16(), lambda x: x - 2),
    "float-tensor / float": (lambda: torch.randn(3), lambda x: torch.div(x, 3.0)),
}


@pytest.mark.parametrize("case", list(SCALAR_OPERANDS), ids=list(SCALAR_OPERANDS))
def test_python_numbers_in_tensor_slots_pass_through_idle_kernels(case):
    # x + 1e-6 calls aten::add.Tensor with a wrapped number, which reaches a Python
    # kernel as a float: an idle kernel must still run the op (it once raised "Expected
    # a value of type 'Tensor'"), with torch's result and dtype, in every kind of region.
    make, op = SCALAR_OPERANDS[case]
    x = make()
    dispatch.release_kernels()  # the oracle: torch with none of amped's kernels
    expected = {
        "torch.autocast": _run(op, (x,), {}, torch.autocast("cpu")),
        "amped default": _run(op, (x,), {}, amped.autocast("cpu")),
        "mode engine": _run(op, (x,), {}, amped.autocast("cpu", policy=WITH_LOW_RULE)),
    }
    arithmetic = _TORCH.with_ops(promote=["add", "sub", "mul", "div"], fp32=["cdist"])
    with amped.autocast("cpu", policy=arithmetic):  # registers the kernels, and uses them
        assert current_path("cpu") is Path.KERNELS
        ours = op(x)
    assert ours.dtype == op(x).dtype
    torch.testing.assert_close(ours, op(x), **BITWISE)  # promote: the one input's dtype
    for label, region in (
        ("torch.autocast", torch.autocast("cpu")),
        ("amped default", amped.autocast("cpu")),
        ("mode engine", amped.autocast("cpu", policy=WITH_LOW_RULE)),
    ):
        got = _run(op, (x,), {}, region)
        assert not isinstance(got, Exception), f"{label}: {got!r}"
        assert got.dtype == expected[label].dtype
        torch.testing.assert_close(got, expected[label], **BITWISE, msg=label)
    dispatch.release_kernels()
