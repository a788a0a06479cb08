"""The GradScaler privates Lightning, Accelerate and the transformers Trainer read, with
torch's types and meaning."""

from __future__ import annotations

import torch

import amped


def _scaled_step(scaler, unscale=False):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.randn(4, 3)).sum()).backward()
    if unscale:
        scaler.unscale_(opt)
    return model, opt


def test_attributes_have_torchs_types():
    ours, theirs = amped.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    for scaler in (ours, theirs):
        _scaled_step(scaler)
    for name in ("_scale", "_growth_tracker"):
        a, b = getattr(ours, name), getattr(theirs, name)
        assert (a.dtype, a.shape, a.device, a.item()) == (b.dtype, b.shape, b.device, b.item())
    assert (ours._enabled, ours._device) == (theirs._enabled, theirs._device)


def test_lazy_init_scale_growth_tracker_as_accelerate_calls_it():
    ours, theirs = (
        amped.GradScaler("cpu", init_scale=8.0),
        torch.amp.GradScaler("cpu", init_scale=8.0),
    )
    for scaler in (ours, theirs):
        scaler._lazy_init_scale_growth_tracker(scaler._device)
    assert torch.equal(ours._scale, theirs._scale)
    assert torch.equal(ours._growth_tracker, theirs._growth_tracker)
    assert ours._growth_tracker.dtype is torch.int32


def test_stage_reads_as_torchs_dict():
    ours, theirs = amped.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    stages = []
    for scaler in (ours, theirs):
        _, opt = _scaled_step(scaler, unscale=True)
        state = scaler._per_optimizer_states[id(opt)]
        stages.append(state["stage"])
        assert set(state["found_inf_per_device"]) == {torch.device("cpu")}
    assert stages[0] is stages[1] is torch.amp.grad_scaler.OptState.UNSCALED


def test_unscale_grads_matches_torch():
    results = []
    for scaler in (amped.GradScaler("cpu"), torch.amp.GradScaler("cpu")):
        model, opt = _scaled_step(scaler)
        found = torch.zeros(())
        flags = scaler._unscale_grads_(opt, torch.full((), 0.5), found, False)
        results.append(([p.grad.clone() for p in model.parameters()], flags))
    (ours, our_flags), (theirs, their_flags) = results
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert {d: f.item() for d, f in our_flags.items()} == {
        d: f.item() for d, f in their_flags.items()
    }
