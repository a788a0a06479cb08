"""O2 (fp16-master, bf16-master): the step equals a hand-written reference bitwise, the
policy decides which modules keep float32 weights, and bad input is refused clearly."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from recipes_helpers import batches, mlp, train
from tolerances import BITWISE, FP32_REORDERED

import amped
from amped.optim import MasterWeightOptimizer
from amped.recipes.weights import kept_in_fp32


def _reference_o2(dtype: torch.dtype, scale: float, data):
    """O2 by hand: low weights except the norm, float32 masters, then per step: cast the
    gradients up, unscale them, step AdamW in float32, cast the masters down."""
    model = mlp()
    policy = amped.Policy.preset("torch", "cpu").with_module(nn.LayerNorm, "fp32")
    pairs, stepped = [], []
    for module in model:
        for p in module.parameters(recurse=False):
            if isinstance(module, nn.Linear):
                master = p.detach().clone()
                p.data = p.data.to(dtype)
                pairs.append((p, master))
                stepped.append(master)
            else:
                stepped.append(p)
    opt = torch.optim.AdamW(stepped, lr=1e-3)
    inv_scale = torch.tensor(scale).double().reciprocal().float()
    losses = []
    for x, y in data:
        with amped.autocast("cpu", dtype=dtype, policy=policy):
            loss = F.cross_entropy(model(x), y)
        (loss * scale).backward()
        for p, master in pairs:
            master.grad = p.grad.float()
        for t in stepped:
            t.grad.mul_(inv_scale)
        assert all(t.grad.isfinite().all() for t in stepped)
        opt.step()
        with torch.no_grad():
            for p, master in pairs:
                p.copy_(master)
        for t in [*stepped, *model.parameters()]:
            t.grad = None
        losses.append(loss.item())
    return model, [m for _, m in pairs], losses


@pytest.mark.parametrize(
    ("recipe", "dtype", "scale"),
    [("fp16-master", torch.float16, 2.0**16), ("bf16-master", torch.bfloat16, 1.0)],
    ids=["fp16", "bf16"],
)
def test_o2_step_equals_hand_written_reference(recipe, dtype, scale):
    """The unfused step (tests/optim/test_recipes_master_fused.py holds the fused one to it)."""
    data = batches(6)
    model = mlp()
    setup = amped.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), recipe)
    setup.optimizer.fused = False
    losses = train(setup, data)
    ref_model, ref_masters, ref_losses = _reference_o2(dtype, scale, data)
    assert losses == ref_losses
    for got, expected in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert got.dtype == expected.dtype
        torch.testing.assert_close(got, expected, **BITWISE)
    masters = [m for _, m in setup.optimizer.pairs]
    for got, expected in zip(masters, ref_masters, strict=True):
        torch.testing.assert_close(got, expected, **BITWISE)
    assert setup.scaler.is_enabled() == (dtype is torch.float16)


def test_weights_are_low_except_norms_and_steps_move_them():
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    setup = amped.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16-master")
    assert [p.dtype for p in model.parameters()] == [torch.bfloat16] * 2 + [torch.float32] * 2 + [
        torch.bfloat16
    ] * 2
    # The masters start from the original float32 weights, not from their rounding.
    for (_, master), original in zip(setup.optimizer.pairs, before[:2] + before[4:], strict=True):
        torch.testing.assert_close(master, original, **BITWISE)
    train(setup, batches(2))
    assert all(p.grad is None for p in setup.optimizer.param_groups[0]["params"])
    for param, master in setup.optimizer.pairs:
        torch.testing.assert_close(param, master.to(param.dtype), **BITWISE)


def test_policy_kept_module_stays_fp32():
    seen = {}

    def probe(name):
        def hook(module, args, output):
            seen[name] = (args[0].dtype, module.weight.dtype)

        return hook

    model = mlp()
    for name, module in model.named_children():
        if hasattr(module, "weight"):
            module.register_forward_hook(probe(name))
    policy = amped.Policy.preset("torch", "cpu").with_module("3", "fp32")
    setup = amped.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16-master", policy=policy
    )
    train(setup, batches(1))
    assert seen == {
        "0": (torch.bfloat16, torch.bfloat16),  # the lowered model casts its inputs
        "1": (torch.float32, torch.float32),  # the norm: float32 by default
        "3": (torch.float32, torch.float32),  # kept by the user's policy
    }
    # A float32 weight is stepped as it is, with no master copy.
    assert setup.optimizer.master_of(model[3].weight) is model[3].weight
    assert setup.optimizer.master_of(model[0].weight) is not model[0].weight


def test_a_user_rule_overrides_the_default_norm_rule():
    model = mlp()
    policy = amped.Policy.preset("torch", "cpu").with_module(nn.LayerNorm, "low")
    amped.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16-master", policy=policy)
    assert model[1].weight.dtype is torch.bfloat16


def test_a_rule_covers_submodules_without_their_own():
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), nn.Linear(2, 2))
    policy = amped.Policy.preset("torch", "cpu").with_module("0", "fp32").with_module("0.1", "low")
    assert kept_in_fp32(model, policy) == {"0", "0.0"}


def test_an_overflowing_fp16_step_is_skipped_and_leaves_no_float32_grads():
    model = mlp()
    setup = amped.prepare(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        "fp16-master",
        scaler=amped.GradScaler("cpu", init_scale=2.0**60),
    )
    before = [p.detach().clone() for p in model.parameters()]
    masters = [m.detach().clone() for _, m in setup.optimizer.pairs]
    x, y = batches(1)[0]
    with setup.autocast():
        loss = F.cross_entropy(setup.model(x), y)
    setup.backward(loss)
    assert setup.step() is False
    assert setup.scaler.get_scale() == 2.0**59
    for got, expected in zip(model.parameters(), before, strict=True):
        torch.testing.assert_close(got, expected, **BITWISE)
    for (_, got), expected in zip(setup.optimizer.pairs, masters, strict=True):
        torch.testing.assert_close(got, expected, **BITWISE)
        assert got.grad is None


def test_clip_grad_norm_clips_the_unscaled_master_grads():
    model = mlp()
    setup = amped.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp16-master")
    x, y = batches(1)[0]
    with setup.autocast():
        loss = F.cross_entropy(setup.model(x), y)
    setup.backward(loss)
    scale = setup.scaler.get_scale()
    expected = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(p.grad.float() / scale) for p in model.parameters()])
    )
    norm = setup.clip_grad_norm_(1e-3)
    torch.testing.assert_close(norm, expected, **FP32_REORDERED)
    stepped = [p for g in setup.optimizer.param_groups for p in g["params"]]
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in stepped]))
    torch.testing.assert_close(clipped, torch.tensor(1e-3), **FP32_REORDERED)
    assert setup.step() is True


def test_wrapper_alone_works_with_schedulers_hooks_and_earlier_state():
    model = nn.Linear(4, 2)
    inner = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    model(torch.ones(1, 4)).sum().backward()
    inner.step()  # momentum state exists before wrapping
    model.bfloat16()
    opt = MasterWeightOptimizer(inner)
    assert set(opt.state) == {m for _, m in opt.pairs}
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    calls = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    model(torch.ones(1, 4, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    scheduler.step()
    assert calls == ["pre"]
    assert inner.param_groups[0]["lr"] == 0.5
    assert model.weight.dtype is torch.bfloat16 and model.weight.grad is None


def test_wrapper_deep_copies_with_its_masters():
    model = mlp()
    setup = amped.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "bf16-master")
    train(setup, batches(1))
    twin = copy.deepcopy(setup.optimizer)
    masters = [m for _, m in twin.pairs]
    assert twin.param_groups[0]["params"][0] is masters[0]
    assert masters[0] is not setup.optimizer.pairs[0][1]
    torch.testing.assert_close(masters[0], setup.optimizer.pairs[0][1], **BITWISE)
    assert set(twin.state) == set(twin.optimizer.state)


def test_bad_input_is_refused():
    model = mlp()
    with pytest.raises(TypeError, match=r"LBFGS cannot step float32 master weights.*closure"):
        amped.prepare(model, torch.optim.LBFGS(model.parameters()), "bf16-master")
    assert model[0].weight.dtype is torch.float32  # refused before anything changed
    low = mlp().bfloat16()
    with pytest.raises(ValueError, match=r"pass the model in float32.*bfloat16"):
        amped.prepare(low, torch.optim.SGD(low.parameters(), lr=0.1), "O2-bf16")
    opt = MasterWeightOptimizer(torch.optim.SGD(low.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="takes no closure"):
        opt.step(lambda: 0.0)
    with pytest.raises(TypeError, match="already steps master weights"):
        MasterWeightOptimizer(opt)
    with pytest.raises(ValueError, match="some parameters appear in more than one"):
        opt.add_param_group({"params": [opt.param_groups[0]["params"][0]]})


def test_added_groups_get_masters_and_the_users_hyper_parameters():
    model = mlp()
    inner = torch.optim.SGD(model[0].parameters(), lr=0.5, momentum=0.9, nesterov=True)
    setup = amped.prepare(model, inner, "bf16-master")
    rest = [p for p in model.parameters() if all(p is not q for q in model[0].parameters())]
    setup.optimizer.add_param_group({"params": rest})
    group = setup.optimizer.param_groups[-1]
    assert (group["lr"], group["momentum"], group["nesterov"]) == (0.5, 0.9, True)
    low = [p for p in rest if p.dtype is torch.bfloat16]
    assert low and all(setup.optimizer.master_of(p).dtype is torch.float32 for p in low)
    before = [p.detach().clone() for p in low]
    with setup.autocast():
        loss = setup.model(torch.randn(4, 32)).float().pow(2).mean()
    setup.backward(loss)
    assert setup.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, low, strict=True))
