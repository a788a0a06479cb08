"""The fused master-weight step against the unfused O2 step (MasterWeightOptimizer with
fused=False, which tests/recipes/test_recipes_o2.py holds to a hand-written reference bitwise):
SGD bitwise, Adam and AdamW within the bounds tests/helpers/tolerances.py reasons; loss scaling,
inf injected, clipping, checkpoints, added groups, and the optimizers it does not run."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from recipes_helpers import batches, mlp
from tolerances import BITWISE, MASTER_FUSED_LOSS_REL, MASTER_FUSED_LOW_DIFFERING

import amped
from amped.optim import MasterWeightOptimizer

OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01),
    "adam-l2-maximize": lambda p: torch.optim.Adam(p, lr=1e-3, weight_decay=0.1, maximize=True),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "sgd-nesterov-decay": lambda p: torch.optim.SGD(
        p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2
    ),
    "sgd-dampening-maximize": lambda p: torch.optim.SGD(
        p, lr=0.05, momentum=0.5, dampening=0.3, maximize=True
    ),
    "sgd-plain": lambda p: torch.optim.SGD(p, lr=0.05),
}
RECIPES = ["bf16-master", "fp16-master"]


def _setup(recipe: str, name: str, fused: bool, scaler=None):
    model = mlp()
    setup = amped.prepare(model, OPTIMIZERS[name](model.parameters()), recipe, scaler=scaler)
    setup.optimizer.fused = fused
    return setup


def _count_inner_steps(setup) -> list[int]:
    """A counter of the inner torch optimizer's own step() calls: the unfused step makes
    one a step, the fused one none (its documented sign: the inner's hooks do not run)."""
    calls = [0]
    inner = setup.optimizer.optimizer

    def hook(*_):
        calls[0] += 1

    inner.register_step_pre_hook(hook)
    return calls


def _train(setup, data, *, clip=None, inject_at=None):
    """The shared loop; ``inject_at``: the step whose first gradient gets an inf."""
    losses, stepped = [], []
    for i, (x, y) in enumerate(data):
        with setup.autocast():
            loss = F.cross_entropy(setup.model(x), y)
        setup.backward(loss)
        if inject_at == i:
            setup.model[0].weight.grad[0, 0] = float("inf")
        if clip is not None:
            setup.clip_grad_norm_(clip)
        stepped.append(setup.step())
        setup.zero_grad()
        losses.append(loss.item())
    return losses, stepped


def _tensors(setup):
    """Model weights, masters and every optimizer state tensor, in a fixed order."""
    out = {f"model.{k}": v for k, v in setup.model.state_dict().items()}
    for i, (_, master) in enumerate(setup.optimizer.pairs):
        out[f"master.{i}"] = master
    stepped = [p for g in setup.optimizer.param_groups for p in g["params"]]
    for i, p in enumerate(stepped):
        for key, value in setup.optimizer.state.get(p, {}).items():
            out[f"state.{i}.{key}"] = value
    return out


def _assert_within_bounds(fused, unfused, steps: int, name: str):
    """SGD: bitwise. Adam: see MASTER_FUSED_* in tests/helpers/tolerances.py."""
    got, expected = _tensors(fused), _tensors(unfused)
    assert got.keys() == expected.keys()
    for key in got:
        a, b = got[key], expected[key]
        assert a.dtype == b.dtype, key
        if name.startswith("sgd") or key.endswith(".step"):
            torch.testing.assert_close(a, b, **BITWISE, msg=key)
        elif key.startswith("model.") and a.dtype in (torch.bfloat16, torch.float16):
            differing = (a != b).float().mean().item()
            assert differing <= MASTER_FUSED_LOW_DIFFERING, (key, differing)
            ulp = torch.finfo(a.dtype).eps * b.float().abs().clamp_min(1e-3)
            assert ((a.float() - b.float()).abs() <= ulp).all(), key
        else:  # float32 masters, norms and moments: one float32 ulp of the update a step
            ulp = torch.finfo(torch.float32).eps * b.abs().max().clamp_min(1e-30)
            assert (a - b).abs().max() <= steps * ulp, (key, (a - b).abs().max(), ulp)


# The two SGD variants with the most options compile kernels of their own, about 4 s each
# with a cold Inductor cache: slow, so that the fast subset stays under 3 minutes.
_OPTIMIZER_PARAMS = [
    pytest.param(name, marks=pytest.mark.slow)
    if name in ("sgd-nesterov-decay", "sgd-dampening-maximize")
    else name
    for name in OPTIMIZERS
]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", _OPTIMIZER_PARAMS)
def test_fused_step_holds_to_the_unfused_one(recipe, name):
    data = batches(4)
    fused, unfused = _setup(recipe, name, True), _setup(recipe, name, False)
    counts = _count_inner_steps(fused), _count_inner_steps(unfused)
    losses, _ = _train(fused, data)
    expected, _ = _train(unfused, data)
    assert [c[0] for c in counts] == [0, len(data)]  # the fused step did run
    if name.startswith("sgd"):
        assert losses == expected
    else:
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(expected), rtol=MASTER_FUSED_LOSS_REL, atol=0
        )
    _assert_within_bounds(fused, unfused, len(data), name)
    assert all(p.grad is None for p, _ in fused.optimizer.pairs)
    assert all(m.grad is None for _, m in fused.optimizer.pairs)


@pytest.mark.parametrize("name", ["adamw", "sgd-momentum"])
def test_an_inf_skips_the_step_and_leaves_masters_and_state_untouched(name):
    data = batches(4)
    runs = []
    for fused in (True, False):
        scaler = amped.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
        setup = _setup("fp16-master", name, fused, scaler)
        calls = _count_inner_steps(setup)
        _train(setup, data[:2])
        before = {k: v.clone() for k, v in _tensors(setup).items()}
        scale = setup.scaler.get_scale()
        _, stepped = _train(setup, data[2:3], inject_at=0)
        assert stepped == [False]
        assert setup.scaler.get_scale() == scale * 0.5
        for key, value in _tensors(setup).items():
            torch.testing.assert_close(value, before[key], **BITWISE, msg=key)
        assert all(m.grad is None for _, m in setup.optimizer.pairs)
        _train(setup, data[3:])
        assert calls[0] == (0 if fused else 3)  # three steps taken, one skipped
        runs.append(setup)
    _assert_within_bounds(runs[0], runs[1], 3, name)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", ["adamw", "sgd-nesterov-decay"])
def test_clipping_steps_the_unscaled_master_gradients(recipe, name):
    data = batches(3)
    fused, unfused = _setup(recipe, name, True), _setup(recipe, name, False)
    counts = _count_inner_steps(fused), _count_inner_steps(unfused)
    _train(fused, data, clip=0.5)
    _train(unfused, data, clip=0.5)
    assert [c[0] for c in counts] == [0, len(data)]
    _assert_within_bounds(fused, unfused, len(data), name)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", ["adamw", "sgd-momentum"])
def test_resuming_from_a_checkpoint_continues_bitwise(recipe, name, tmp_path):
    data = batches(5)
    whole = _setup(recipe, name, True)
    _train(whole, data)
    first = _setup(recipe, name, True)
    _train(first, data[:2])
    torch.save(first.state_dict(), tmp_path / "ckpt.pt")
    resumed = _setup(recipe, name, True)
    resumed.load_state_dict(torch.load(tmp_path / "ckpt.pt"))
    _train(resumed, data[2:])
    got, expected = _tensors(resumed), _tensors(whole)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], **BITWISE, msg=key)


def test_state_dict_round_trips_into_a_plain_torch_optimizer():
    setup = _setup("bf16-master", "adamw", True)
    _train(setup, batches(2))
    saved = setup.optimizer.state_dict()
    plain = torch.optim.AdamW(mlp().parameters(), lr=1e-3, weight_decay=0.01)
    plain.load_state_dict(saved)
    again = plain.state_dict()
    assert again["param_groups"] == saved["param_groups"]
    for index, entry in saved["state"].items():
        assert list(entry) == ["step", "exp_avg", "exp_avg_sq"]  # torch's layout
        for key, value in entry.items():
            torch.testing.assert_close(again["state"][index][key], value, **BITWISE)


@pytest.mark.parametrize("name", ["adamw", "sgd-momentum"])
def test_added_groups_and_parameters_that_miss_steps(name):
    """A group added after two steps starts at its own first step (Adam's count, SGD's
    buffer), alongside groups that have stepped: the fused step splits them."""
    runs = []
    for fused in (True, False):
        model = mlp()
        first = list(model[0].parameters())
        setup = amped.prepare(model, OPTIMIZERS[name](first), "bf16-master")
        setup.optimizer.fused = fused
        data = batches(4)
        _train(setup, data[:2])
        rest = [p for p in model.parameters() if all(p is not q for q in first)]
        setup.optimizer.add_param_group({"params": rest})
        _train(setup, data[2:])
        runs.append(setup)
    _assert_within_bounds(runs[0], runs[1], 4, name)


def test_an_optimizer_it_does_not_run_keeps_the_unfused_step_with_one_warning():
    model = mlp().bfloat16()
    with pytest.warns(RuntimeWarning, match="fused master-weight step runs torch.optim.Adam"):
        opt = MasterWeightOptimizer(torch.optim.RMSprop(model.parameters(), lr=1e-3))
    twin = mlp().bfloat16()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain = MasterWeightOptimizer(torch.optim.RMSprop(twin.parameters(), lr=1e-3), fused=False)
        x = torch.randn(4, 32, dtype=torch.bfloat16)
        for net, optimizer in ((model, opt), (twin, plain)):
            net(x).float().pow(2).mean().backward()
            optimizer.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, **BITWISE)
    with pytest.raises(TypeError, match=r"fused=True cannot step this optimizer.*amsgrad=True"):
        MasterWeightOptimizer(
            torch.optim.AdamW(mlp().bfloat16().parameters(), amsgrad=True), fused=True
        )


def test_norm_layers_run_in_float32_without_a_python_mode_in_the_forward():
    """The recipe's own hooks give the norm rule bitwise what the policy's module rule
    gave through amped's engine (the O2 oracle), and nothing in the forward runs under
    a Python mode."""
    from amped._internal.torch_compat import python_mode_active

    model = mlp()
    reference = mlp()
    setup = amped.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16-master")
    seen = []
    model[0].register_forward_hook(lambda *_: seen.append(python_mode_active()))
    policy = amped.Policy.preset("torch", "cpu").with_module(nn.LayerNorm, "fp32")
    reference[0].bfloat16()
    reference[3].bfloat16()
    x, y = batches(1)[0]
    with setup.autocast():
        loss = F.cross_entropy(setup.model(x), y)
    with amped.autocast("cpu", dtype=torch.bfloat16, policy=policy):
        expected = F.cross_entropy(reference(x.bfloat16()), y)
    assert seen == [False]
    torch.testing.assert_close(loss, expected, **BITWISE)
    loss.backward()
    expected.backward()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, **BITWISE)


@pytest.mark.slow
def test_gpt2_norms_match_the_module_rule_bitwise():
    """transformers' GPT-2 (LayerNorm in every block): loss and every gradient of the
    bf16-master forward with the recipe's hooks equal those under the module rule."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        n_positions=32,
        vocab_size=256,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,  # no dropout: the two forwards draw no random numbers
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    reference = GPT2LMHeadModel(config)
    reference.load_state_dict(model.state_dict())
    setup = amped.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16-master")
    for module in reference.modules():
        if not isinstance(module, nn.LayerNorm):
            for p in module.parameters(recurse=False):
                p.data = p.data.bfloat16()
    policy = amped.Policy.preset("torch", "cpu").with_module(nn.LayerNorm, "fp32")
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with setup.autocast():
        loss = setup.model(input_ids=ids, labels=ids).loss
    with amped.autocast("cpu", dtype=torch.bfloat16, policy=policy):
        expected = reference(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss, expected, **BITWISE)
    loss.backward()
    expected.backward()
    for (name, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, **BITWISE, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", ["adamw", "sgd-nesterov-decay"])
def test_fused_step_holds_to_the_unfused_one_on_cuda(recipe, name):
    """The Triton kernel (torch.compile on CUDA) against torch's CUDA step, which is its
    foreach one there: within the Adam bounds for both optimizers (CUDA's eager kernels
    place their fused multiply-adds in their own way). Not yet run on hardware."""
    data = [(x.cuda(), y.cuda()) for x, y in batches(4)]
    runs = []
    for fused in (True, False):
        model = mlp().cuda()
        setup = amped.prepare(model, OPTIMIZERS[name](model.parameters()), recipe)
        setup.optimizer.fused = fused
        _train(setup, data)
        runs.append(setup)
    _assert_within_bounds(runs[0], runs[1], len(data), "adam")
