"""Region semantics that must match torch.autocast: state, nesting, threads, caching,
what is cast and what is not, errors, and custom autograd Functions.

Every test runs twice: as a user gets it (the default policy's casts left to torch's
C++ autocast, see amped.autocast_mode.state) and through amped's engine, forced on with
``forced_path(Path.MODE)``, so each property holds for the engine itself too."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from tolerances import BITWISE

import amped
from amped.autocast_mode.engine import forced_path
from amped.autocast_mode.state import Path

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture(autouse=True, params=["default", "engine"])
def path(request):
    """The region's path: the default, or amped's engine forced on (this thread)."""
    if request.param == "engine":
        with forced_path(Path.MODE):
            yield request.param
    else:
        yield request.param


def mats(n=4, dtype=FP32):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, n, generator=g, dtype=dtype), torch.randn(n, n, generator=g, dtype=dtype)


# --- torch's thread-local state ----------------------------------------------------------


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=str)
def test_region_sets_torch_state_and_restores_it(dtype):
    assert not torch.is_autocast_enabled("cpu")
    with amped.autocast("cpu", dtype=dtype):
        assert torch.is_autocast_enabled("cpu")
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == dtype
    assert not torch.is_autocast_enabled("cpu")
    assert torch.get_autocast_dtype("cpu") == BF16


def test_default_dtypes_follow_torch():
    assert amped.autocast("cpu").fast_dtype == torch.autocast("cpu").fast_dtype == BF16
    assert amped.autocast("cuda", enabled=False).fast_dtype == FP16


def test_nested_torch_autocast_disabled_turns_amped_off():
    # transformers wraps rotary-embedding math like this to force float32.
    a, b = mats()
    with amped.autocast("cpu"):
        with torch.autocast("cpu", enabled=False):
            assert torch.mm(a, b).dtype == FP32
            assert not torch.is_autocast_enabled("cpu")
        assert torch.mm(a, b).dtype == BF16


def test_nested_torch_autocast_other_dtype_applies_amped_policy_at_that_dtype():
    a, b = mats()
    policy = amped.Policy.preset("torch", "cpu").with_ops(fp32=["mm"], dtype=FP16)
    with amped.autocast("cpu", policy=policy):
        assert torch.mm(a, b).dtype == BF16
        with torch.autocast("cpu", dtype=FP16):
            assert torch.mm(a, b).dtype == FP32  # amped's fp16 rule, not torch's C++ one
            assert torch.matmul(a, b).dtype == FP16


def test_amped_region_inside_torch_region():
    a, b = mats()
    with torch.autocast("cpu"), amped.autocast("cpu", dtype=FP16):
        assert torch.mm(a, b).dtype == FP16
    assert not torch.is_autocast_enabled("cpu")


def test_nesting_restores_outer_state_also_on_exceptions():
    a, b = mats()
    with amped.autocast("cpu"):
        with pytest.raises(ValueError, match="boom"), amped.autocast("cpu", dtype=FP16):
            assert torch.mm(a, b).dtype == FP16
            raise ValueError("boom")
        assert torch.get_autocast_dtype("cpu") == BF16
        with amped.autocast("cpu", enabled=False):
            assert torch.mm(a, b).dtype == FP32
        assert torch.mm(a, b).dtype == BF16


def test_decorator_use():
    a, b = mats()

    @amped.autocast("cpu")
    def forward(x, y):
        return torch.mm(x, y)

    assert forward(a, b).dtype == BF16
    assert forward.__name__ == "forward"
    assert torch.mm(a, b).dtype == FP32


def test_decorator_rejects_non_callable():
    with pytest.raises(TypeError, match="requires a callable"):
        amped.autocast("cpu")(3)


def test_recursive_decorated_function_reuses_one_instance():
    region = amped.autocast("cpu")
    a, b = mats()

    @region
    def depth(n):
        return torch.mm(a, b).dtype if n == 0 else depth(n - 1)

    assert depth(3) == BF16


def test_state_is_per_thread():
    a, b = mats()
    seen = {}
    inside, release = threading.Event(), threading.Event()

    def worker():
        with amped.autocast("cpu"):
            seen["worker"] = torch.mm(a, b).dtype
            inside.set()
            release.wait(10)

    t = threading.Thread(target=worker)
    t.start()
    inside.wait(10)
    seen["main"] = torch.mm(a, b).dtype  # main thread is outside any region
    seen["main_enabled"] = torch.is_autocast_enabled("cpu")
    release.set()
    t.join(10)
    assert seen == {"worker": BF16, "main": FP32, "main_enabled": False}


# --- what is cast ------------------------------------------------------------------------


@pytest.mark.parametrize("region", ["torch", "amped"])
def test_float64_integer_and_other_devices_are_left_alone(region):
    ctx = torch.autocast("cpu") if region == "torch" else amped.autocast("cpu")
    d = torch.randn(4, 4, dtype=torch.float64)
    i = torch.arange(16).reshape(4, 4)
    with ctx:
        assert torch.mm(d, d).dtype == torch.float64
        assert torch.mm(i, i).dtype == torch.int64
        assert torch.cat([d.float(), torch.ones(4, 4, dtype=BF16)]).dtype == FP32


def test_casts_are_differentiable_back_to_float32_weights():
    lin = nn.Linear(4, 3)
    with amped.autocast("cpu"):
        out = lin(torch.randn(2, 4))
    assert out.dtype == BF16
    out.float().sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.dtype == FP32


@pytest.mark.parametrize("cache_enabled", [True, False])
def test_weight_cache_matches_torch_bitwise(cache_enabled):
    # A weight used twice: with the cache both uses share one cast (gradients summed in
    # bfloat16 before the cast back), without it each use casts again. torch does the
    # same, so gradients match bitwise either way.
    torch.manual_seed(0)
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(4, 16)

    def step(region):
        w.grad = None
        with region:
            y = F.linear(F.linear(x, w).float().tanh(), w)
        y.float().sum().backward()
        return w.grad.clone()

    expected = step(torch.autocast("cpu", cache_enabled=cache_enabled))
    got = step(amped.autocast("cpu", cache_enabled=cache_enabled))
    torch.testing.assert_close(got, expected, **BITWISE)


def test_cache_holds_weights_only_for_the_outermost_region():
    """A weight's cast is served until the outermost region closes (torch's rule): a
    change in place meanwhile is not seen; a tensor that is not a weight, a region with
    ``cache_enabled=False``, and the next outermost region cast afresh."""
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(4, 4)

    def bump():
        with torch.no_grad():
            w.add_(1)

    with amped.autocast("cpu"):
        first = F.linear(x, w)
        bump()
        with amped.autocast("cpu"):
            assert torch.equal(F.linear(x, w), first)  # the cached, pre-change cast
        assert not torch.equal(F.linear(x, w.detach()), first)  # not a weight: cast now
    with amped.autocast("cpu"):
        assert not torch.equal(F.linear(x, w), first)
    with amped.autocast("cpu", cache_enabled=False):
        before = F.linear(x, w)
        bump()
        assert not torch.equal(F.linear(x, w), before)


def test_backward_inside_region_matches_torch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    x = torch.randn(4, 8)

    def step(region):
        model.zero_grad()
        with region:
            model(x).float().pow(2).mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    for got, expected in zip(step(amped.autocast("cpu")), step(torch.autocast("cpu")), strict=True):
        torch.testing.assert_close(got, expected, **BITWISE)


# --- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize("device_type", ["not_a_device", "meta"])
def test_unsupported_device_type_raises_like_torch(device_type):
    with pytest.raises(RuntimeError) as torch_error:
        torch.autocast(device_type)
    # Same exception type; amped's message also says which device types work (torch's
    # says "unsupported scalarType" for "meta").
    with pytest.raises(RuntimeError, match="'cpu' and 'cuda'") as amped_error:
        amped.autocast(device_type)
    assert type(amped_error.value) is type(torch_error.value)


def test_device_type_must_be_a_string():
    with pytest.raises(ValueError, match="device_type"):
        amped.autocast(torch.device("cpu"))  # type: ignore[arg-type]


def test_unsupported_dtype_warns_and_disables_like_torch():
    a, b = mats()
    with pytest.warns(UserWarning, match="only supports dtypes of torch.bfloat16, torch.float16"):
        region = amped.autocast("cpu", dtype=torch.float32)
    assert not region.enabled
    with region:
        assert not torch.is_autocast_enabled("cpu")
        assert torch.mm(a, b).dtype == FP32


def test_cuda_without_cuda_warns_and_disables_like_torch():
    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    with warnings.catch_warnings(record=True) as torch_warnings:
        warnings.simplefilter("always")
        torch.autocast("cuda")
    with pytest.warns(UserWarning, match="CUDA is not available") as ours:
        region = amped.autocast("cuda")
    assert not region.enabled
    assert [str(w.message) for w in torch_warnings] == [str(w.message) for w in ours]


def test_policy_for_another_device_is_refused():
    with pytest.raises(ValueError, match="policy is for 'cuda'"):
        amped.autocast("cpu", policy=amped.Policy.preset("torch", "cuda"))


def test_policy_of_wrong_type_is_refused():
    with pytest.raises(TypeError, match="policy must be"):
        amped.autocast("cpu", policy=42)  # type: ignore[arg-type]


def test_unknown_preset_name_is_refused():
    with pytest.raises(ValueError, match="Unknown policy preset 'fast'"):
        amped.autocast("cpu", policy="fast")


# --- custom autograd Functions -----------------------------------------------------------


class _MatmulFloat32(torch.autograd.Function):
    @staticmethod
    @amped.custom_fwd(device_type="cpu", cast_inputs=FP32)
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        assert not torch.is_autocast_enabled("cpu")
        return torch.mm(a, b)

    @staticmethod
    @amped.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return torch.mm(grad, b.t()), torch.mm(a.t(), grad)


class _MatmulAutocast(torch.autograd.Function):
    @staticmethod
    @amped.custom_fwd(device_type="cpu")
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return torch.mm(a, b)

    @staticmethod
    @amped.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        ctx.backward_dtype = torch.mm(grad, b.t()).dtype
        assert torch.is_autocast_enabled("cpu")
        return torch.mm(grad, b.t()), torch.mm(a.t(), grad)


def test_custom_fwd_cast_inputs_runs_forward_in_float32_without_autocast():
    a = torch.randn(4, 4, dtype=BF16, requires_grad=True)
    b = torch.randn(4, 4, requires_grad=True)
    with amped.autocast("cpu"):
        out = _MatmulFloat32.apply(a, b)
    assert out.dtype == FP32
    out.sum().backward()
    assert a.grad.dtype == BF16 and b.grad.dtype == FP32


def test_custom_fwd_cast_inputs_outside_a_region_is_a_no_op():
    a, b = mats()
    assert _MatmulFloat32.apply(a.to(BF16), a.to(BF16)).dtype == BF16
    assert _MatmulFloat32.apply(a, b).dtype == FP32


def test_custom_bwd_runs_backward_under_forward_autocast_state():
    a = torch.randn(4, 4, requires_grad=True)
    b = torch.randn(4, 4, requires_grad=True)
    with amped.autocast("cpu"):
        out = _MatmulAutocast.apply(a, b)
    assert out.dtype == BF16
    out.float().sum().backward()  # outside the region: custom_bwd re-enters it
    assert out.grad_fn.backward_dtype == BF16


def test_custom_fwd_matches_torch_custom_fwd():
    class TorchFn(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type="cpu", cast_inputs=FP32)
        def forward(ctx, a, b):
            return torch.mm(a, b)

        @staticmethod
        @torch.amp.custom_bwd(device_type="cpu")
        def backward(ctx, grad):
            return grad, grad

    a = torch.randn(4, 4, dtype=BF16)
    with torch.autocast("cpu"):
        expected = TorchFn.apply(a, a)
    with amped.autocast("cpu"):
        got = _MatmulFloat32.apply(a, a)
    torch.testing.assert_close(got, expected, **BITWISE)


def test_custom_fwd_needs_device_type_as_string():
    with pytest.raises(TypeError):
        amped.custom_fwd(lambda ctx: None)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="device_type"):
        amped.custom_fwd(device_type=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="device_type"):
        amped.custom_bwd(device_type=None)  # type: ignore[arg-type]


# --- Python composites -------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["redispatch", "clone"])
def test_ops_inside_python_composites_reach_the_policy(strategy, monkeypatch):
    # F.multi_head_attention_forward is Python; its inner linear/bmm/softmax must be cast
    # by the policy. torch >= 2.13 skips one hop of torch-function dispatch; older
    # releases use a copy of the function whose has_torch_function checks return False.
    from amped.autocast_mode import transparent

    if strategy == "clone":
        monkeypatch.setattr(transparent, "call", transparent.call_with_clone)
    elif not hasattr(torch._C, "_skip_one_hop_torch_function"):
        pytest.skip("this torch cannot skip one hop of torch-function dispatch")
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4)
    x = torch.randn(5, 2, 16)

    def step(region):
        mha.zero_grad()
        with region:
            out = mha(x, x, x)[0]
        out.float().sum().backward()
        return out, [p.grad.clone() for p in mha.parameters()]

    out, grads = step(amped.autocast("cpu"))
    expected, expected_grads = step(torch.autocast("cpu"))
    torch.testing.assert_close(out, expected, **BITWISE)
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, **BITWISE)
    policy = amped.Policy.preset("torch", "cpu").with_ops(fp32=["softmax", "bmm", "baddbmm"])
    seen: list[torch.dtype] = []
    monkeypatch.setattr(torch.Tensor, "softmax", _spy(torch.Tensor.softmax, seen))
    with amped.autocast("cpu", policy=policy):
        mha(x, x, x)
    assert seen and all(dtype == FP32 for dtype in seen)  # bfloat16 under the default


def _spy(method, seen):
    def spied(self, *args, **kwargs):
        out = method(self, *args, **kwargs)
        seen.append(out.dtype)
        return out

    return spied
