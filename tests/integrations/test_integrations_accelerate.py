"""amped's Accelerator against Accelerate's own mixed precision, the hand-written loop,
and Accelerate's save_state/load_state."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate")
from accelerate import Accelerator as AccelerateAccelerator
from accelerate.state import AcceleratorState
from integration_helpers import (
    STEPS_PER_EPOCH,
    batches,
    hand_loop,
    loss_of,
    make_net,
    make_optimizer,
    reset_accelerate_state,
)

import amped
from amped.integrations.accelerate import Accelerator
from amped.recipes.registry import recipe_names

RECIPES = recipe_names()  # every registered recipe, fp32 first


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    reset_accelerate_state()
    yield
    reset_accelerate_state()


def _equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def train(
    acc,
    steps=range(2 * STEPS_PER_EPOCH),
    clip=None,
    schedule=False,
    overflow_at=(),
    fused=False,
    state=None,
    save_to=None,
):
    net = make_net()
    opt = make_optimizer(net.parameters(), fused=fused)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s if schedule else 1.0)
    net, opt, sched = acc.prepare(net, opt, sched)
    if state is not None:
        acc.load_state(state)
    losses, skipped = [], []
    data = batches()
    for step in steps:
        x, y = data[step % STEPS_PER_EPOCH]
        with acc.accumulate(net):
            loss = loss_of(net(x), y)
            if step in overflow_at:
                loss = loss * float("inf")
            losses.append(loss.detach().clone())
            acc.backward(loss)
            if clip is not None and acc.sync_gradients:
                acc.clip_grad_norm_(net.parameters(), clip)
            opt.step()
            sched.step()
            opt.zero_grad()
            if acc.sync_gradients:
                skipped.append(acc.optimizer_step_was_skipped)
    if save_to is not None:
        acc.save_state(save_to)
    return losses, [p.detach().clone() for p in net.parameters()], sched, skipped, acc


def _accelerate_fp16_on_cpu():
    # Accelerate turns fp16 off on CPU (it trains in float32 there). Its own fp16 code
    # path (autocast to float16, a torch GradScaler in backward and step) is switched
    # on by hand, exactly as its constructor does on a GPU.
    acc = AccelerateAccelerator(mixed_precision="fp16", cpu=True)
    acc.native_amp = True
    acc.scaler = torch.amp.GradScaler("cpu")
    return acc


@pytest.mark.parametrize("recipe", ["bf16-mixed", "fp16-mixed"])
def test_accelerate_matches_its_own_mixed_precision_bitwise(recipe):
    if recipe == "bf16-mixed":
        theirs = AccelerateAccelerator(mixed_precision="bf16", cpu=True)
    else:
        theirs = _accelerate_fp16_on_cpu()
    ref = train(theirs, clip=0.5, schedule=True)
    AcceleratorState._reset_state(True)
    ours = train(Accelerator(recipe=recipe, cpu=True), clip=0.5, schedule=True)
    assert _equal(ref[0], ours[0])
    assert _equal(ref[1], ours[1])


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipe_in_accelerate_is_the_hand_written_loop(recipe):
    acc = Accelerator(recipe=recipe, cpu=True)
    losses, *_ = train(acc, clip=0.05)
    ref, setup, report = hand_loop(recipe, clip=0.05)
    assert _equal(losses, ref)
    assert acc.memory_report() == report
    model = acc.unwrap_model(acc.setup.model, keep_fp32_wrapper=False)
    assert model.forward.__func__ is type(model).forward  # Accelerate's unwrap finds it
    acc.teardown()
    setup.teardown()
    assert _equal(list(acc.setup.model.parameters()), list(setup.model.parameters()))


def test_accelerate_accumulates_gradients_like_the_hand_written_loop():
    acc = Accelerator(recipe="fp16-master", cpu=True, gradient_accumulation_steps=STEPS_PER_EPOCH)
    losses, *_ = train(acc, clip=0.05)
    ref, setup, _ = hand_loop("fp16-master", clip=0.05, accumulate=STEPS_PER_EPOCH)
    assert _equal(losses, ref)
    setup.teardown()
    acc.teardown()
    assert _equal(list(acc.setup.model.parameters()), list(setup.model.parameters()))


@pytest.mark.parametrize("recipe", ["fp16-mixed", "fp16-master", "bf16-pure-sr"])
def test_accelerate_resume_is_bitwise_with_overflows(recipe, tmp_path):
    overflows = (1, 4) if recipe.startswith("fp16") else ()
    whole = train(Accelerator(recipe=recipe, cpu=True), schedule=True, overflow_at=overflows)
    AcceleratorState._reset_state(True)
    first = train(
        Accelerator(recipe=recipe, cpu=True),
        steps=range(3),
        schedule=True,
        overflow_at=overflows,
        save_to=tmp_path / "state",
    )
    AcceleratorState._reset_state(True)
    second = train(
        Accelerator(recipe=recipe, cpu=True),
        steps=range(3, 6),
        schedule=True,
        overflow_at=overflows,
        state=tmp_path / "state",
    )
    assert _equal(whole[0], first[0] + second[0])
    assert _equal(whole[1], second[1])
    assert whole[4].recipe_scaler.state_dict() == second[4].recipe_scaler.state_dict()
    if overflows:
        # optimizer_step_was_skipped tells the truth, and the scheduler skips with it.
        assert whole[3] == [step in overflows for step in range(6)]
        assert whole[2].scheduler.last_epoch == 6 - len(overflows)
        assert (tmp_path / "state" / "scaler.pt").exists()


def test_fused_optimizer_with_clipping_matches_accelerate():
    # Accelerate allows it (it unscales before clipping, and the fused step is then told
    # not to unscale again); so does amped's Accelerator, with the same result.
    ref = train(_accelerate_fp16_on_cpu(), clip=0.05, fused=True)
    AcceleratorState._reset_state(True)
    ours = train(Accelerator(recipe="fp16-mixed", cpu=True), clip=0.05, fused=True)
    assert _equal(ref[0], ours[0])
    assert _equal(ref[1], ours[1])


def test_bad_arguments_fail_at_construction():
    with pytest.raises(ValueError, match="Unknown recipe"):
        Accelerator(recipe="bf17-mixed", cpu=True)
    with pytest.raises(ValueError, match="instead of mixed_precision"):
        Accelerator(recipe="bf16-mixed", mixed_precision="bf16", cpu=True)
    with pytest.raises(ValueError, match="policy is for device 'cuda'"):
        Accelerator(recipe="bf16-mixed", policy=amped.Policy.preset("torch", "cuda"), cpu=True)


def test_model_and_optimizer_prepared_in_separate_calls():
    acc = Accelerator(recipe="bf16-master", cpu=True)
    net = make_net()
    opt = make_optimizer(net.parameters())
    net = acc.prepare(net)
    opt = acc.prepare(opt)
    assert acc.setup is not None and acc.setup.model is net
    assert opt.optimizer is acc.setup.optimizer
    x, y = batches()[0]
    acc.backward(loss_of(net(x), y))
    opt.step()
    assert not acc.optimizer_step_was_skipped
    assert net[0].weight.dtype is torch.bfloat16
