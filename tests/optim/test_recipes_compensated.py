"""CompensatedSGD and CompensatedAdamW: torch's algorithms on float32 weights; on bfloat16
weights they follow the float32 trajectory where plain bfloat16 stalls."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from repo_paths import TESTS
from tolerances import BITWISE, FP32_REORDERED, SR_SIGMAS

from amped.optim import CompensatedAdamW, CompensatedSGD
from data import make_compensated_checkpoint_v0 as checkpoint_v0

SGD_CONFIGS = {
    "plain": dict(lr=0.1),
    "momentum": dict(lr=0.1, momentum=0.9, weight_decay=0.01),
    "nesterov": dict(lr=0.1, momentum=0.9, nesterov=True),
    "dampening-maximize": dict(lr=0.1, momentum=0.5, dampening=0.3, maximize=True),
}
ADAM_CONFIGS = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), {}),
    "adam-l2": (
        torch.optim.Adam,
        dict(lr=1e-2, weight_decay=0.1),
        dict(decoupled_weight_decay=False),
    ),
    "adamw-maximize": (torch.optim.AdamW, dict(lr=1e-2, betas=(0.8, 0.99), maximize=True), {}),
}


def _run(opt_factory, dtype=torch.float32, steps=10, start=None):
    g = torch.Generator().manual_seed(0)
    param = (start if start is not None else torch.randn(50, generator=g)).to(dtype)
    param.requires_grad_(True)
    opt = opt_factory([param])
    for _ in range(steps):
        param.grad = torch.randn(50, generator=g).to(dtype)
        opt.step()
    return param, opt


@pytest.mark.parametrize("config", SGD_CONFIGS.values(), ids=SGD_CONFIGS.keys())
def test_sgd_on_float32_is_torchs_sgd(config):
    got, _ = _run(lambda p: CompensatedSGD(p, **config))
    expected, _ = _run(lambda p: torch.optim.SGD(p, **config))
    torch.testing.assert_close(got, expected, **FP32_REORDERED)


@pytest.mark.parametrize(
    ("torch_cls", "config", "extra"), ADAM_CONFIGS.values(), ids=ADAM_CONFIGS.keys()
)
def test_adamw_on_float32_is_torchs_adam(torch_cls, config, extra):
    got, _ = _run(lambda p: CompensatedAdamW(p, **config, **extra))
    expected, _ = _run(lambda p: torch_cls(p, **config))
    torch.testing.assert_close(got, expected, **FP32_REORDERED)


QUADRATIC_STEPS, QUADRATIC_SIZE = 600, 2048


def _quadratic(opt_factory, dtype, steps=QUADRATIC_STEPS):
    """Pull 1.0 towards 0.5 with gradient (p - 0.5): each update is below half a
    bfloat16 ulp at 1.0 (2**-9), so plain bfloat16 cannot move."""
    param = torch.ones(QUADRATIC_SIZE, dtype=dtype, requires_grad=True)
    opt = opt_factory([param])
    for _ in range(steps):
        param.grad = (param.detach().float() - 0.5).to(dtype)
        opt.step()
    return param.detach().float(), opt


OPTIMIZERS = {
    "sgd": (
        lambda p, **kw: CompensatedSGD(p, lr=1e-4, momentum=0.9, **kw),
        lambda p: torch.optim.SGD(p, lr=1e-4, momentum=0.9),
    ),
    "adamw": (
        lambda p, **kw: CompensatedAdamW(p, lr=1e-4, weight_decay=0.0, **kw),
        lambda p: torch.optim.AdamW(p, lr=1e-4, weight_decay=0.0),
    ),
}


@pytest.mark.parametrize("compensation", ["kahan", "stochastic"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_bf16_follows_the_float32_trajectory_where_plain_bf16_stalls(name, compensation):
    ours, plain = OPTIMIZERS[name]
    reference, _ = _quadratic(plain, torch.float32)
    naive, _ = _quadratic(plain, torch.bfloat16)
    got, _ = _quadratic(lambda p: ours(p, compensation=compensation), torch.bfloat16)
    assert (naive == 1.0).all()  # plain bfloat16 missed the whole move
    error = got - reference
    ulp = 2.0**-8  # a bfloat16 ulp in [0.5, 1), where the weights stay
    if compensation == "kahan":
        # Every weight ends within one ulp of float32's: weight plus compensation
        # carries ~16 bits, and rounding the weight alone costs at most half an ulp.
        assert error.abs().max() <= ulp
        assert error.abs().mean() < 0.1 * (1.0 - reference).mean()
    else:
        # Each step's stochastic rounding adds unbiased noise of at most one ulp
        # (variance <= ulp**2 / 4) to a weight, so over the steps the mean error of
        # the weights has a standard deviation <= ulp / 2 * sqrt(steps / size).
        sigma = ulp / 2 * (QUADRATIC_STEPS / QUADRATIC_SIZE) ** 0.5
        assert abs(error.mean().item()) < SR_SIGMAS * sigma


def test_state_is_low_precision_and_the_second_moment_decays():
    param = torch.ones(2000, dtype=torch.bfloat16, requires_grad=True)
    opt = CompensatedAdamW([param], lr=0.0, weight_decay=0.0, betas=(0.9, 0.999))
    param.grad = torch.ones_like(param)
    opt.step()
    state = opt.state[param]
    assert {k: v.dtype for k, v in state.items() if torch.is_tensor(v)} == {
        "exp_avg": torch.bfloat16,
        "exp_avg_sq": torch.bfloat16,
        "compensation": torch.bfloat16,
    }
    v0 = state["exp_avg_sq"].float().mean().item()
    param.grad = torch.zeros_like(param)
    for _ in range(693):  # 0.999**693 = 0.5
        opt.step()
    # Round-to-nearest would freeze the second moment (0.1% < half an ulp); the
    # stochastic rounding keeps its mean on 0.999**t. Per element the rounding noise
    # is at most one ulp per step (2**-8 relative), so the mean over 2000 elements
    # after 693 unbiased steps has a standard deviation below 2**-8 * sqrt(693 / 2000).
    sigma = 2.0**-8 * (693 / 2000) ** 0.5 * v0
    assert abs(state["exp_avg_sq"].float().mean().item() - 0.5 * v0) < SR_SIGMAS * sigma
    assert state["step"] == 694


@pytest.mark.parametrize("compensation", ["kahan", "stochastic"])
def test_state_dict_round_trip_continues_bitwise(compensation):
    start = torch.randn(50, generator=torch.Generator().manual_seed(5))
    param, opt = _run(
        lambda p: CompensatedAdamW(p, lr=1e-2, compensation=compensation, seed=3),
        dtype=torch.bfloat16,
        start=start,
    )
    buffer = io.BytesIO()
    torch.save({"param": param.detach(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    twin = saved["param"].clone().requires_grad_(True)
    twin_opt = CompensatedAdamW([twin], lr=1e-2, compensation=compensation, seed=99)
    twin_opt.load_state_dict(saved["opt"])
    g = torch.Generator().manual_seed(11)
    grads = [torch.randn(50, generator=g).bfloat16() for _ in range(3)]
    for p, o in ((param, opt), (twin, twin_opt)):
        for grad in grads:
            p.grad = grad.clone()
            o.step()
    torch.testing.assert_close(twin, param, **BITWISE)
    for key, value in opt.state[param].items():
        if torch.is_tensor(value):
            torch.testing.assert_close(twin_opt.state[twin][key], value, **BITWISE)


def test_deepcopy_and_closure():
    param = torch.ones(3, dtype=torch.bfloat16, requires_grad=True)
    opt = CompensatedSGD([param], lr=0.1)

    def closure():
        param.grad = torch.ones_like(param)
        return 1.5

    assert opt.step(closure) == 1.5
    assert copy.deepcopy(opt).state_dict()["state"].keys() == opt.state_dict()["state"].keys()


def test_bad_arguments_are_refused():
    p = [torch.zeros(2, requires_grad=True)]
    with pytest.raises(
        ValueError, match=r"compensation must be one of.*Received: compensation='exact'"
    ):
        CompensatedSGD(p, compensation="exact")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"lr must be >= 0.0\. Received: lr=-1"):
        CompensatedAdamW(p, lr=-1)
    with pytest.raises(TypeError, match=r"Received: lr='fast' \(of type str\)"):
        CompensatedSGD(p, lr="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"betas\[1\] must be in \[0.0, 1.0\)"):
        CompensatedAdamW(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="Nesterov momentum requires"):
        CompensatedSGD(p, nesterov=True)
    sparse = torch.zeros(4, requires_grad=True)
    sparse.grad = torch.zeros(4).to_sparse()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        CompensatedSGD([sparse]).step()


# Written by amped ddcec43, whose optimizers drew one randint per tensor and write and
# built their chunks afresh at every step (tests/data/make_compensated_checkpoint_v0.py):
# per case, three steps on two bfloat16 parameters, the state dict, two more steps.
CHECKPOINT_V0 = TESTS / "data" / "compensated_checkpoint_v0.pt"


def _resume(name):
    kind, config, compensation = checkpoint_v0.CASES[name]
    saved = torch.load(CHECKPOINT_V0, weights_only=True)[name]
    params = [p.clone().requires_grad_(True) for p in saved["params"]]
    opt = kind(params, **config, compensation=compensation, seed=0)
    opt.load_state_dict(saved["optimizer"])
    for step in (3, 4):
        for param, grad in zip(params, checkpoint_v0.grads(step), strict=True):
            param.grad = grad
        opt.step()
    return saved, params, opt


@pytest.mark.parametrize("name", ["adamw-kahan", "sgd-kahan"])
def test_checkpoint_of_the_earlier_version_continues_bitwise(name):
    """Where no write rounds stochastically (betas[1] = 0.95, momentum 0.9), the step
    is deterministic, and resuming the old state dict gives the old weights and state."""
    saved, params, opt = _resume(name)
    for param, expected in zip(params, saved["continued"], strict=True):
        torch.testing.assert_close(param.detach(), expected, **BITWISE)
    for index, param in enumerate(params):
        state = opt.state[param]
        assert state.keys() == saved["continued_state"][index].keys()
        for key, value in saved["continued_state"][index].items():
            assert (state[key] == value) if key == "step" else torch.equal(state[key], value)
    assert opt._generator is None  # nothing was rounded stochastically


def test_checkpoint_of_the_earlier_version_resumes_its_random_stream():
    """The random state is the generator's, as before: it loads, and resuming twice
    from it gives the same steps (the bits themselves are new: amped.optim.noise)."""
    saved, params, opt = _resume("adamw-stochastic")
    _, params_again, _ = _resume("adamw-stochastic")
    for param, twin in zip(params, params_again, strict=True):
        torch.testing.assert_close(param, twin, **BITWISE)
    assert opt.seed == 7
    assert sorted(opt.state_dict()) == sorted(saved["optimizer"])
    expected = torch.Generator()
    expected.set_state(saved["optimizer"]["rng_state"])
    for _ in range(2):  # a step draws three keys (one per write) in one call
        torch.empty(3, dtype=torch.int32).random_(generator=expected)
    assert torch.equal(opt._generator.get_state(), expected.get_state())


def test_kept_plan_sees_new_parameter_data_and_new_gradients():
    """The plan keeps work rows between steps, never views of parameters, gradients or
    state: replacing a parameter's data, its gradient or its state (load_state_dict)
    between steps is seen, as by an optimizer built afresh from the same state."""
    g = torch.Generator().manual_seed(1)
    params = [torch.randn(n, generator=g).bfloat16().requires_grad_(True) for n in (300, 7)]
    opt = CompensatedAdamW(params, lr=1e-2)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).bfloat16()
        opt.step()
    params[0].data = torch.randn(300, generator=g).bfloat16()
    twins = [p.detach().clone().requires_grad_(True) for p in params]
    twin_opt = CompensatedAdamW(twins, lr=1e-2)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # new state tensors
    for p, t in zip(params, twins, strict=True):
        p.grad = torch.randn(p.shape, generator=g).bfloat16()
        t.grad = p.grad.clone()
    opt.step()
    twin_opt.step()
    for p, t in zip(params, twins, strict=True):
        torch.testing.assert_close(p, t, **BITWISE)
        for key in ("exp_avg", "exp_avg_sq", "compensation"):
            torch.testing.assert_close(opt.state[p][key], twin_opt.state[t][key], **BITWISE)


@pytest.mark.parametrize("fused", [False, True, None], ids=["eager", "fused", "auto"])
def test_load_state_dict_keeps_the_optimizers_fused_setting(fused):
    model = torch.nn.Linear(4, 2).bfloat16()
    optimizer = CompensatedAdamW(model.parameters(), fused=fused)
    optimizer.load_state_dict(CompensatedAdamW(model.parameters()).state_dict())
    assert optimizer.fused is fused
