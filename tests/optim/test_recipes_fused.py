"""The compensated optimizers' fused step (one compiled kernel per chunk) against the eager step.

The eager step is held bitwise to a frozen per-tensor reference
(tests/optim/test_recipes_compensated_reference.py); the fused step computes the same
algorithm in one torch.compile'd kernel, whose float32 roundings differ from eager's
in the last bit in places (amped.optim.fused says where), so it is held to the eager
step within the bounds in tests/helpers/tolerances.py. Both run side by side from the same
parameters, gradients and seed, step after step: weights, every state tensor, step
counts and the random stream.
"""

from __future__ import annotations

import copy
import gc
import os
import pickle
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch
from tolerances import (
    BITWISE,
    FUSED_AMPLIFIED,
    FUSED_CANCELLATION,
    FUSED_DIFFERING,
    FUSED_KAHAN_REL,
    FUSED_UPDATE_REL,
)
from torch.utils._python_dispatch import TorchDispatchMode

from amped.optim import CompensatedAdamW, CompensatedSGD, compensated, fused
from amped.optim.chunks import partition

STEPS = 5
DEVICES = ["cpu"] + (
    [pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else []
)
CONFIGS = {
    "adamw": (CompensatedAdamW, dict(lr=1e-3, weight_decay=0.01)),
    "sgd-momentum-wd": (CompensatedSGD, dict(lr=1e-2, momentum=0.9, weight_decay=1e-3)),
}
SLOW_CONFIGS = {  # each another kernel variant to compile
    # 1 - 0.99 < 2**-6: the first moment rounds stochastically under Kahan too.
    "adamw-slow-beta1": (CompensatedAdamW, dict(lr=1e-3, betas=(0.99, 0.999))),
    # beta2 0.95: no write rounds stochastically under Kahan.
    "adam-l2-maximize": (
        CompensatedAdamW,
        dict(lr=1e-3, betas=(0.8, 0.95), weight_decay=0.1, decoupled_weight_decay=False)
        | dict(maximize=True),
    ),
    "sgd-nesterov": (CompensatedSGD, dict(lr=1e-2, momentum=0.9, nesterov=True)),
    "sgd-slow-momentum": (CompensatedSGD, dict(lr=1e-2, momentum=0.99, dampening=0.1)),
}


def _params(low, device):
    """Two groups: tensors large enough for the kernels' rounding differences to show,
    a transposed one (state in its layout, not laid out flat), float32 ones, a group
    whose only low-precision tensor has one element (the eager step's)."""
    g = torch.Generator().manual_seed(0)

    def make(*shape, dtype=low):
        return (torch.randn(shape, generator=g) * 2).to(device, dtype)

    first = [make(64, 300), make(300), make(40, 50).t(), make(7), make(100, dtype=torch.float32)]
    second = [make(1), make(30, dtype=torch.float32)]
    return [[p.requires_grad_(True) for p in group] for group in (first, second)]


def _twins(kind, config, compensation, low, device):
    pair = []
    for fused_step in (True, False):
        params = _params(low, device)
        groups = [{"params": params[0]}, {"params": params[1], "lr": config["lr"] / 2}]
        opt = kind(groups, **config, compensation=compensation, seed=3, fused=fused_step)
        pair.append((params, opt))
    return pair


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for group in params:
        for p in group:
            p.grad = (torch.randn(p.shape, generator=g) * 0.5).to(p.device, p.dtype)


def _assert_close_low(got, expected, what):
    """Within one ulp of the dtype, elementwise, plus the float32 error a cancellation
    leaves (FUSED_CANCELLATION ulps of the tensor's largest value); different on few
    elements."""
    assert got.dtype == expected.dtype and got.shape == expected.shape, what
    a, b = got.double(), expected.double()
    ulp = torch.finfo(got.dtype).eps * torch.maximum(a.abs(), b.abs())
    cancellation = FUSED_CANCELLATION * 2.0**-24 * b.abs().max()
    differ = a != b
    assert ((a - b).abs() <= ulp + cancellation).all(), what
    assert differ.double().mean() <= FUSED_DIFFERING, (what, differ.double().mean())


def _totals(params, opt):
    """Each low-precision weight plus its Kahan compensation, in float32."""
    return [
        p.detach().float() + opt.state[p]["compensation"].float()
        for group in params
        for p in group
        if "compensation" in opt.state.get(p, {})
    ]


def _assert_close(pair, compensation, paths, steps):
    """``paths``: per Kahan weight of the eager side, the sum of its moves so far."""
    (ours, opt), (theirs, ref) = pair
    for group, ref_group in zip(ours, theirs, strict=True):
        for p, q in zip(group, ref_group, strict=True):
            state, ref_state = opt.state[p], ref.state[q]
            assert state.keys() == ref_state.keys()
            if p.dtype == torch.float32 or p.numel() == 1:  # eager in both
                torch.testing.assert_close(p, q, **BITWISE)
                for key, value in state.items():
                    assert (
                        torch.equal(value, ref_state[key])
                        if torch.is_tensor(value)
                        else (value == ref_state[key])
                    )
                continue
            _assert_close_low(p.detach(), q.detach(), "weight")
            for key, value in state.items():
                if key == "compensation":
                    continue  # in the Kahan sum below
                if torch.is_tensor(value):
                    _assert_close_low(value, ref_state[key], key)
                else:
                    assert value == ref_state[key], key
    if compensation == "kahan":
        lr = max(group["lr"] for group in ref.param_groups)
        for total, ref_total, path in zip(
            _totals(ours, opt), _totals(theirs, ref), paths, strict=True
        ):
            weight = ref_total.abs()
            bound = FUSED_KAHAN_REL * weight + FUSED_CANCELLATION * 2.0**-24 * weight.max()
            error = (total - ref_total).abs()
            outside = error > bound + FUSED_UPDATE_REL * path
            # Adam divides each gradient by its own magnitude: a gradient that cancels
            # (maximize's -grad plus an equal L2 term) to zero in one step and to a
            # float32 remainder in the other moves by 0 or by up to lr (see tolerances).
            assert outside.double().mean() <= FUSED_AMPLIFIED, outside.double().mean()
            assert (error[outside] <= steps * lr).all()
    if ref._generator is None:
        assert opt._generator is None
    else:
        assert torch.equal(opt._generator.get_state(), ref._generator.get_state())


@pytest.fixture
def kernel_calls(monkeypatch):
    """How many chunks the fused kernels stepped (a spy: the kernels still run)."""
    calls = []
    real = fused.run

    def spy(*args, **kwargs):
        calls.append(args[0].__name__)
        return real(*args, **kwargs)

    monkeypatch.setattr(fused, "run", spy)
    return calls


def _run_pair(name, configs, compensation, low, device, kernel_calls):
    kind, config = configs[name]
    pair = _twins(kind, config, compensation, low, device)
    for params, opt in pair:
        _grads(params, 0)
        opt.step()
    before = _totals(*pair[1])
    paths = [torch.zeros_like(total) for total in before]
    for step in range(1, STEPS):
        for params, opt in pair:
            _grads(params, step)
            opt.step()
        after = _totals(*pair[1])
        paths = [path + (a - b).abs() for path, a, b in zip(paths, after, before, strict=True)]
        before = after
        _assert_close(pair, compensation, paths, step + 1)
    # SGD's first step is eager (its buffer starts as the gradient); the rest fused.
    assert len(kernel_calls) >= STEPS - 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compensation", ["kahan", "stochastic"])
@pytest.mark.parametrize("name", CONFIGS)
def test_fused_step_follows_the_eager_step(name, compensation, device, kernel_calls):
    _run_pair(name, CONFIGS, compensation, torch.bfloat16, device, kernel_calls)


@pytest.mark.slow
@pytest.mark.parametrize("compensation", ["kahan", "stochastic"])
@pytest.mark.parametrize("name", SLOW_CONFIGS)
def test_fused_step_follows_the_eager_step_in_every_variant(name, compensation, kernel_calls):
    _run_pair(name, SLOW_CONFIGS, compensation, torch.bfloat16, "cpu", kernel_calls)


@pytest.mark.parametrize("name", CONFIGS)
def test_float16_takes_the_eager_step(name, kernel_calls):
    """The kernel splits totals at bfloat16's precision; float16 stays eager, bitwise."""
    kind, config = CONFIGS[name]
    (ours, opt), (theirs, ref) = _twins(kind, config, "kahan", torch.float16, "cpu")
    for step in range(3):
        for params, optimizer in ((ours, opt), (theirs, ref)):
            _grads(params, step)
            optimizer.step()
    for p, q in zip(ours[0] + ours[1], theirs[0] + theirs[1], strict=True):
        torch.testing.assert_close(p, q, **BITWISE)
        for key, value in opt.state[p].items():
            if torch.is_tensor(value):
                torch.testing.assert_close(value, ref.state[q][key], **BITWISE)
    assert kernel_calls == []


def test_large_tensors_are_cut_into_pieces_across_chunks(monkeypatch, kernel_calls):
    """Chunks of 2,000 elements: the 19,200-element weight is stepped in pieces."""
    monkeypatch.setattr(compensated, "_FUSED_CHUNK_BYTES", 2 * 5 * 2000)
    _run_pair("adamw", CONFIGS, "kahan", torch.bfloat16, "cpu", kernel_calls)
    assert len(kernel_calls) >= STEPS * 10


def test_large_tensors_are_chunks_of_their_own(monkeypatch, kernel_calls):
    """From _ALONE elements on, a tensor is stepped in its own memory, no copies: here
    the 19,200- and 2,000-element weights, between chunks of the smaller ones."""
    monkeypatch.setattr(compensated, "_ALONE", 1000)
    assert [[p.stop - p.start for p in c] for c in partition(
        [torch.zeros(n) for n in (7, 1000, 3, 5, 2000)], 4000, lambda p: True, 1000
    )] == [[7], [1000], [3, 5], [2000]]  # fmt: skip
    _run_pair("adamw", CONFIGS, "stochastic", torch.bfloat16, "cpu", kernel_calls)


def test_state_is_laid_out_flat_and_not_copied(monkeypatch):
    """A step's new state is one tensor per key (views for each parameter), after
    load_state_dict too, so the fused step copies only gradients and weights in, and
    weights out: three copies per chunk, not nine."""
    params = [torch.randn(n, 8).bfloat16().requires_grad_(True) for n in (50, 70, 9)]
    opt = CompensatedAdamW(params, fused=True)
    copies = []
    real = compensated.foreach_copy_

    def counted(dst, src):
        copies.append(len(dst))
        real(dst, src)

    monkeypatch.setattr(compensated, "foreach_copy_", counted)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    for key in ("exp_avg", "exp_avg_sq", "compensation"):
        storages = {opt.state[p][key].untyped_storage().data_ptr() for p in params}
        assert len(storages) == 1, key
    assert copies == [3, 3, 3]  # one chunk: gradients in, weights in, weights out
    twin = CompensatedAdamW([p.detach().clone().requires_grad_(True) for p in params])
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    for key in ("exp_avg", "exp_avg_sq", "compensation"):
        storages = {s[key].untyped_storage().data_ptr() for s in twin.state.values()}
        assert len(storages) == 1, key


def test_no_gradient_outlives_zero_grad():
    """A tensor stepped in its own memory (2**20 elements or more) has a flat gradient:
    the step must not keep it once zero_grad lets it go (nor the old state's memory once
    load_state_dict replaced it)."""
    param = torch.nn.Parameter(torch.randn(1 << 20).bfloat16())
    opt = CompensatedAdamW([param], lr=1e-3, fused=True)
    param.grad = torch.randn(param.shape).bfloat16()
    grad = weakref.ref(param.grad.untyped_storage())
    opt.step()
    opt.zero_grad(set_to_none=True)
    gc.collect()
    assert grad() is None
    state = weakref.ref(opt.state[param]["exp_avg"].untyped_storage())
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    gc.collect()
    assert state() is None


def test_resuming_from_a_state_dict_continues_bitwise():
    """Saved and loaded between steps (the loaded state laid out anew), the fused step
    goes on exactly as without the interruption."""
    runs = []
    for interrupt in (False, True):
        params = _params(torch.bfloat16, "cpu")
        flat = [p for group in params for p in group]
        opt = CompensatedAdamW(flat, lr=1e-3, compensation="stochastic", seed=5)
        for step in range(4):
            _grads(params, step)
            opt.step()
            if interrupt and step == 1:
                saved = pickle.loads(pickle.dumps(opt.state_dict()))
                clones = [p.detach().clone().requires_grad_(True) for p in flat]
                opt = CompensatedAdamW(clones, lr=1e-3, compensation="stochastic", seed=0)
                opt.load_state_dict(saved)
                params = [clones[:5], clones[5:]]
                flat = clones
        runs.append(flat)
    for p, q in zip(*runs, strict=True):
        torch.testing.assert_close(p, q, **BITWISE)


def test_under_a_dispatch_mode_the_step_is_eager(kernel_calls):
    """torch.compile does not trace under a Python mode (a memory or FLOP counter):
    the step is the eager one there, bitwise, and nothing is compiled or disabled."""

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    (ours, opt), (theirs, ref) = _twins(
        CompensatedAdamW, CONFIGS["adamw"][1], "kahan", torch.bfloat16, "cpu"
    )
    for step in range(2):
        _grads(ours, step)
        _grads(theirs, step)
        with Passthrough():
            opt.step()
        ref.step()
    for p, q in zip(ours[0] + ours[1], theirs[0] + theirs[1], strict=True):
        torch.testing.assert_close(p, q, **BITWISE)
    assert kernel_calls == []
    assert fused.available("cpu") is None


def test_bad_fused_argument_is_refused():
    with pytest.raises(TypeError, match="fused must be True, False or None"):
        CompensatedAdamW([torch.zeros(3, requires_grad=True)], fused="yes")


def test_old_pickles_without_the_fused_attribute_load():
    opt = CompensatedSGD([torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)], lr=0.1)
    state = opt.__getstate__()
    del state["fused"]
    restored = CompensatedSGD.__new__(CompensatedSGD)
    restored.__setstate__(state)
    assert restored.fused is None


_NO_COMPILER = """
import warnings, torch
from amped.optim import CompensatedAdamW

def run(fused):
    g = torch.Generator().manual_seed(0)
    p = (torch.randn(5000, generator=g)).bfloat16().requires_grad_(True)
    opt = CompensatedAdamW([p], fused=fused)
    for _ in range(3):
        p.grad = torch.randn(5000, generator=g).bfloat16()
        opt.step()
    return p

try:
    run(True)
except RuntimeError as error:
    print("strict:", "fused=True needs torch.compile" in str(error), "C++ compiler" in str(error))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    auto = run(None)
print("warned:", any("could not compile their fused step" in str(w.message) for w in caught))
print("equal:", torch.equal(auto, run(False)))
"""


@pytest.mark.slow
def test_without_a_cpp_compiler_fused_true_raises_and_none_falls_back(tmp_path):
    """A real failure to compile (no C++ compiler, an empty Inductor cache): fused=True
    says what is missing; fused=None warns once and steps eagerly, with the eager
    step's results."""
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"))
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_NO_COMPILER)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:3] == ["strict: True True", "warned: True", "equal: True"]


def test_the_fused_step_leaves_amped_regions_on_their_fast_path(monkeypatch, kernel_calls):
    # The kernels compile outside any region with autocast off: their graphs can never
    # run inside a region (Dynamo guards on autocast), so regions opened after the first
    # step keep their path (amped.autocast_mode.engine).
    import amped
    from amped.autocast_mode import Path, current_path

    monkeypatch.setattr(fused, "_compiled", {})  # so that the kernel compiles in this test
    compiles = []
    callbacks = torch._dynamo.callback_handler
    callbacks.register_start_callback(compiles.append)
    try:
        params, opt = _twins(CompensatedAdamW, dict(lr=1e-3), "kahan", torch.bfloat16, "cpu")[0]
        _grads(params, 0)
        opt.step()
    finally:
        callbacks.remove_start_callback(compiles.append)
    assert compiles and kernel_calls  # compiled, and stepped by the kernel
    torch_policy = amped.Policy.preset("torch", "cpu")
    with amped.autocast("cpu", policy=torch_policy.with_ops(fp32=["mm"])):
        assert current_path("cpu") is Path.KERNELS
    with amped.autocast("cpu", policy=torch_policy.with_module(torch.nn.LayerNorm, "fp32")):
        assert current_path("cpu") is Path.TORCH
