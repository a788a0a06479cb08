"""CompensatedSGD and CompensatedAdamW against a frozen per-tensor reference, bitwise.

The optimizers step their parameters in chunks, through flat float32 work tensors
(see amped.optim.compensated). The reference below is the algorithm they replaced
(amped 752a332), written plainly: one parameter at a time, its gradient, state and
weight copied to float32, NaNs kept by isnan + where. Its random bits are those of
amped.optim.noise, computed here on their own: each step that rounds stochastically
draws one int32 key per write from the generator, and the element numbered ``n``
(counting the step's bfloat16 elements with a gradient on the device, parameter after
parameter, group after group, each in row-major order) gets the top 16 bits of
lowbias32(key + n), in int64 arithmetic with products of at most 48 bits.
Parameters, every state tensor, the step counts and the random stream must come out
bitwise equal, step after step: same hyper-parameters, same grouping, both
compensations, float32 parameters among bfloat16 ones, a parameter without a gradient
and one whose gradient arrives late.

This is the eager step (``fused=False``); tests/optim/test_recipes_fused.py holds the fused
step (one compiled kernel per chunk) to it, within the bounds it states.
"""

from __future__ import annotations

import math

import pytest
import torch

from amped.optim import CompensatedAdamW, CompensatedSGD, compensated

STEPS = 3  # the third brings the late gradient: chunks of fresh and stepped state
# On CUDA too, where there is one: the chunks run torch's elementwise kernels over a
# flat buffer, which must not depend on where an element sits in it.
DEVICES = ["cpu"] + (
    [pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else []
)
SLOW_DECAY = 2.0**-6


_MASK = (1 << 32) - 1


def _ref_mul32(x, constant):
    """``x * constant`` mod 2**32 for int64 ``x`` in [0, 2**32), in 16-bit halves."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK


def _ref_noise(key, first, shape, device):
    """Top 16 bits of lowbias32(key + first + i) for i in 0..numel, in ``shape``."""
    numel = math.prod(shape)
    x = (torch.arange(numel, dtype=torch.int64, device=device) + (key + first)) & _MASK
    x = _ref_mul32(x ^ (x >> 16), 0x7FEB352D)
    x = _ref_mul32(x ^ (x >> 15), 0x846CA68B)
    return (x >> 16).to(torch.int32).view(shape)


def _ref_stochastic_round(target, value, noise):
    value = value.contiguous()
    rounded = noise.add_(value.view(torch.int32)).bitwise_and_(-(1 << 16)).view(torch.float32)
    target.copy_(torch.where(value.isnan(), value, rounded))


def _ref_kahan_add(param, update, compensation):
    wanted = update.add_(compensation)
    total = param.to(torch.float32, copy=True).add_(wanted)
    param.copy_(total)
    compensation.copy_(total.sub_(param))


class Reference:
    """The per-tensor CompensatedSGD / CompensatedAdamW, on the groups of a twin."""

    def __init__(self, kind, groups, seed):
        self.kind, self.groups, self.seed = kind, groups, seed
        self.writes = 2 if kind is CompensatedSGD else 3
        self.state = {}
        self.generator = None
        self.keys = None  # this step's, once drawn
        self.first = {}  # the number of each bfloat16 parameter's first element

    def noise(self, param, write):
        if self.keys is None:
            if self.generator is None:
                self.generator = torch.Generator(param.device).manual_seed(self.seed)
            keys = torch.empty(self.writes, dtype=torch.int32, device=param.device)
            self.keys = keys.random_(generator=self.generator).tolist()
        return _ref_noise(self.keys[write], self.first[param], param.shape, param.device)

    def store(self, buffer, value, group, decay, write, param):
        stochastic = 1 - decay < SLOW_DECAY  # slow averages only, under both compensations
        if buffer.dtype is torch.bfloat16 and stochastic:
            _ref_stochastic_round(buffer, value, self.noise(param, write))
        else:
            buffer.copy_(value)

    def apply(self, param, update, state, group):
        if param.dtype not in (torch.bfloat16, torch.float16):
            param.add_(update)
        elif group["compensation"] == "kahan":
            if "compensation" not in state:
                state["compensation"] = torch.zeros_like(param)
            _ref_kahan_add(param, update, state["compensation"])
        else:
            noise = self.noise(param, self.writes - 1)
            _ref_stochastic_round(param, update.add_(param), noise)

    @torch.no_grad()
    def step(self):
        self.keys, self.first, counted = None, {}, {}
        for group in self.groups:
            for param in group["params"]:
                if param.grad is not None and param.dtype is torch.bfloat16:
                    self.first[param] = counted.get(param.device, 0)
                    counted[param.device] = self.first[param] + param.numel()
        for group in self.groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad.to(torch.float32, copy=True)
                if group["maximize"]:
                    grad.neg_()
                state = self.state.setdefault(param, {})
                if self.kind is CompensatedSGD:
                    self.sgd(param, grad, state, group)
                else:
                    self.adam(param, grad, state, group)

    def sgd(self, param, grad, state, group):
        if group["weight_decay"] != 0:
            grad.add_(param, alpha=group["weight_decay"])
        momentum = group["momentum"]
        if momentum != 0:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = torch.empty_like(param)
                velocity = grad.clone()
            else:
                velocity = buf.to(torch.float32, copy=True).mul_(momentum)
                velocity.add_(grad, alpha=1 - group["dampening"])
            self.store(buf, velocity, group, momentum, 0, param)
            grad = grad.add_(velocity, alpha=momentum) if group["nesterov"] else velocity
        self.apply(param, grad.mul_(-group["lr"]), state, group)

    def adam(self, param, grad, state, group):
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(param)
            state["exp_avg_sq"] = torch.zeros_like(param)
        state["step"] += 1
        step, lr, wd = state["step"], group["lr"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        if wd != 0 and not group["decoupled_weight_decay"]:
            grad.add_(param, alpha=wd)
        exp_avg = state["exp_avg"].to(torch.float32, copy=True).lerp_(grad, 1 - beta1)
        exp_avg_sq = state["exp_avg_sq"].to(torch.float32, copy=True).mul_(beta2)
        exp_avg_sq.addcmul_(grad, grad, value=1 - beta2)
        self.store(state["exp_avg"], exp_avg, group, beta1, 0, param)
        self.store(state["exp_avg_sq"], exp_avg_sq, group, beta2, 1, param)
        step_size = lr / (1 - beta1**step)
        denom = exp_avg_sq.sqrt_().div_(math.sqrt(1 - beta2**step)).add_(group["eps"])
        update = exp_avg.div_(denom).mul_(-step_size)
        if wd != 0 and group["decoupled_weight_decay"]:
            update.add_(param, alpha=-lr * wd)
        self.apply(param, update, state, group)


SGD_CONFIGS = {
    "plain": dict(lr=0.1),
    "momentum-wd": dict(lr=0.1, momentum=0.9, weight_decay=0.01),
    "nesterov": dict(lr=0.1, momentum=0.9, nesterov=True),
    "dampening-maximize": dict(lr=0.1, momentum=0.5, dampening=0.3, maximize=True),
    "slow-momentum": dict(lr=0.1, momentum=0.995),  # stochastically rounded buffer
}
ADAM_CONFIGS = {
    "adamw": dict(lr=1e-2, weight_decay=0.1),
    "adam-l2": dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=False),
    "adamw-maximize-slow-betas": dict(lr=1e-2, betas=(0.99, 0.999), maximize=True),
    "no-decay": dict(lr=3e-3, weight_decay=0.0, eps=1e-6),
}
CONFIGS = {f"sgd-{k}": (CompensatedSGD, v) for k, v in SGD_CONFIGS.items()} | {
    k: (CompensatedAdamW, v) for k, v in ADAM_CONFIGS.items()
}


def _params(low, device):
    """Two groups of parameters: odd sizes (vector tails), a transposed and a
    channels-last one, float32 ones among them, a scalar, an empty one, one that never
    gets a gradient and one that gets it from the third step on."""
    g = torch.Generator().manual_seed(0)

    def make(*shape, dtype=low):
        return (torch.randn(shape, generator=g) * 2).to(device, dtype)

    first = [
        make(7, 5),
        make(5, 7).t(),
        make(6, dtype=torch.float32),
        make(33),
        make(),
        make(3, 4, 2, 2).contiguous(memory_format=torch.channels_last),
        make(4),  # never a gradient
        make(9),  # a gradient from the third step on
        make(0, 3),
    ]
    second = [make(10), make(3, dtype=torch.float32), make(40)]
    return [[p.requires_grad_(True) for p in group] for group in (first, second)]


def _grads(params, step, g):
    for group in params:
        for i, p in enumerate(group):
            never, late = group is params[0] and i == 6, group is params[0] and i == 7
            if never or (late and step < 2):
                p.grad = None
            else:
                p.grad = (torch.randn(p.shape, generator=g) * 0.5).to(p.device, p.dtype)


def _twins(kind, config, compensation, low, device, seed=7):
    ours = _params(low, device)
    theirs = [[p.detach().clone().requires_grad_(True) for p in group] for group in ours]
    groups = [{"params": ours[0]}, {"params": ours[1], "lr": config["lr"] / 2}]
    opt = kind(groups, **config, compensation=compensation, seed=seed, fused=False)
    ref_groups = [{**g, "params": t} for g, t in zip(opt.param_groups, theirs, strict=True)]
    return ours, opt, theirs, Reference(kind, ref_groups, seed)


def _assert_bitwise(ours, opt, theirs, ref):
    for group, ref_group in zip(ours, theirs, strict=True):
        for p, q in zip(group, ref_group, strict=True):
            assert p.dtype == q.dtype and p.stride() == q.stride()
            assert torch.equal(p, q)
            state, ref_state = opt.state.get(p, {}), ref.state.get(q, {})
            assert state.keys() == ref_state.keys()
            for key, value in state.items():
                if torch.is_tensor(value):
                    assert value.dtype == ref_state[key].dtype, key
                    assert torch.equal(value, ref_state[key]), key
                else:
                    assert value == ref_state[key], key
    if ref.generator is None:
        assert opt._generator is None
    else:
        assert torch.equal(opt._generator.get_state(), ref.generator.get_state())


def _run_both(kind, config, compensation, low=torch.bfloat16, device="cpu"):
    ours, opt, theirs, ref = _twins(kind, config, compensation, low, device)
    for step in range(STEPS):
        _grads(ours, step, torch.Generator().manual_seed(100 + step))
        _grads(theirs, step, torch.Generator().manual_seed(100 + step))
        opt.step()
        ref.step()
        _assert_bitwise(ours, opt, theirs, ref)


@pytest.fixture(params=["chunk-default", "chunk-small"])
def chunk_bytes(request, monkeypatch):
    """The default chunk holds all these parameters at once; 448 bytes (12 elements of
    AdamW, 16 of SGD) splits them into many chunks, cuts the contiguous tensors larger
    than a chunk into pieces, and sends the others (transposed, channels-last) alone."""
    if request.param == "chunk-small":
        monkeypatch.setattr(compensated, "_CHUNK_BYTES", 448)
    return request.param


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compensation", ["kahan", "stochastic"])
@pytest.mark.parametrize("name", CONFIGS)
def test_bitwise_equal_to_the_per_tensor_reference(name, compensation, chunk_bytes, device):
    kind, config = CONFIGS[name]
    _run_both(kind, config, compensation, device=device)


@pytest.mark.parametrize("name", ["sgd-momentum-wd", "sgd-slow-momentum", "adamw", "adam-l2"])
def test_float16_under_kahan_is_bitwise_equal_to_the_reference(name, chunk_bytes):
    kind, config = CONFIGS[name]
    _run_both(kind, config, "kahan", low=torch.float16)


def test_stochastic_float16_is_refused_before_anything_is_written():
    bf16 = torch.ones(3, dtype=torch.bfloat16, requires_grad=True)
    fp16 = torch.ones(3, dtype=torch.float16, requires_grad=True)
    bf16.grad, fp16.grad = torch.ones_like(bf16), torch.ones_like(fp16)
    opt = CompensatedAdamW([bf16, fp16], compensation="stochastic")
    with pytest.raises(ValueError, match=r"implemented for bfloat16.*dtype=torch.float16"):
        opt.step()
    assert (bf16 == 1).all() and not opt.state and opt._generator is None


def test_work_memory_is_bounded_and_kept_between_steps(monkeypatch):
    """The work rows of a step (module docstring): 36 bytes per element for AdamW (four
    float32 rows; three int32 noise rows, scratch and counters), for the largest chunk:
    at most _CHUNK_BYTES, a larger contiguous parameter being cut into pieces, any other
    going alone. Allocated when the parameters change, then kept: a step allocates only
    its three random keys."""
    monkeypatch.setattr(compensated, "_CHUNK_BYTES", 36 * 64)
    params = [torch.randn(n).bfloat16().requires_grad_(True) for n in (40, 30, 7, 50)]
    opt = CompensatedAdamW(params, compensation="stochastic", fused=False)
    for p in params:
        p.grad = torch.randn_like(p)
    state = 2 * 2 * sum(p.numel() for p in params)  # exp_avg and exp_avg_sq, bfloat16
    # Chunks of at most 64 elements: (40,), (30, 7), (50,); the work fits the largest.
    assert _allocated_bytes(opt.step) == state + 36 * 50 + 12
    assert _allocated_bytes(opt.step) == 12
    big = torch.randn(100).bfloat16().requires_grad_(True)  # pieces of 64 and 36
    strided = torch.randn(10, 12).bfloat16().t().requires_grad_(True)  # alone
    for p in (big, strided):
        p.grad = torch.randn_like(p)
    opt.add_param_group({"params": [big]})
    assert _allocated_bytes(opt.step) == 2 * 2 * 100 + 36 * 64 + 12
    assert _allocated_bytes(opt.step) == 12
    opt.add_param_group({"params": [strided]})
    assert _allocated_bytes(opt.step) == 2 * 2 * 120 + 36 * 120 + 12
    strided.grad = None  # the parameters change: the plan is rebuilt for the rest
    assert _allocated_bytes(opt.step) == 36 * 64 + 12


def _allocated_bytes(fn):
    """Bytes of the new storages the ops called by ``fn`` return (scalars aside)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Allocations(TorchDispatchMode):
        nbytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen = {
                t.untyped_storage().data_ptr()
                for t in tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor)
            }
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.numel() > 1:
                    storage = t.untyped_storage()
                    if storage.data_ptr() not in seen:
                        seen.add(storage.data_ptr())
                        Allocations.nbytes += storage.nbytes()
            return out

    with Allocations():
        fn()
    return Allocations.nbytes


@pytest.mark.parametrize("name", ["sgd-slow-momentum", "adamw"])
def test_bfloat16_float16_and_float32_in_one_group_are_bitwise_equal_to_the_reference(
    name, chunk_bytes
):
    """One group of three dtypes under Kahan: three partitions, and the random bits
    (bfloat16's slow averages) numbered over the bfloat16 parameters only."""
    kind, config = CONFIGS[name]
    g = torch.Generator().manual_seed(3)
    dtypes = [torch.bfloat16, torch.float16, torch.float32, torch.bfloat16, torch.float16]
    ours = [
        (torch.randn(17 + i, generator=g)).to(d).requires_grad_(True) for i, d in enumerate(dtypes)
    ]
    theirs = [p.detach().clone().requires_grad_(True) for p in ours]
    opt = kind(ours, **config, compensation="kahan", seed=5)
    ref = Reference(kind, [{**opt.param_groups[0], "params": theirs}], seed=5)
    for _ in range(STEPS):
        for p, q in zip(ours, theirs, strict=True):
            p.grad = (torch.randn(p.shape, generator=g) * 0.5).to(p.dtype)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
        _assert_bitwise([ours], opt, [theirs], ref)
