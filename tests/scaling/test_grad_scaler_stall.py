"""No silent stall: after an overflow burst the scaler recovers, warns once, or raises.

The scenario: a float16 model under autocast overflows for 200 steps in a
row (a NaN loss), the scale falls to the floor (2**-126), and there every float16
gradient flushes to zero. torch's rule then takes 126 * growth_interval steps to climb
back; amped's default restores the last clean scale on the first stalled step.
"""

from __future__ import annotations

import math
import pickle
import warnings

import pytest
import torch
from torch import nn

import amped
from amped.scaling import ScaleStallError, stall
from amped.scaling.checks import SCALE_FLOOR

WARMUP, BURST, CLEAN = 5, 200, 50


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _step(model, scaler, optimizer, step: int, poison: bool) -> None:
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(4, 8, generator=generator)
    optimizer.zero_grad()
    with amped.autocast("cpu", dtype=torch.float16):
        loss = (model(x).float() - 1.0).pow(2).mean()
    if poison:
        loss = loss * math.nan
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _moved(before: list[torch.Tensor], model: nn.Module) -> bool:
    return any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def _burst(model, scaler, optimizer) -> None:
    for step in range(WARMUP):
        _step(model, scaler, optimizer, step, poison=False)
    for step in range(WARMUP, WARMUP + BURST):
        _step(model, scaler, optimizer, step, poison=True)


@pytest.mark.parametrize(
    "fused", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["sgd", "adam-fused"]
)
def test_burst_then_params_move_within_50_clean_steps_with_one_warning(fused: bool) -> None:
    model = _model()
    if fused:
        optimizer: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), fused=True)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = amped.GradScaler("cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _burst(model, scaler, optimizer)
        assert scaler.get_scale() == SCALE_FLOOR
        before = _params(model)
        moved_at = None
        for step in range(CLEAN):
            _step(model, scaler, optimizer, WARMUP + BURST + step, poison=False)
            if _moved(before, model):
                moved_at = step
                break
        if fused:
            # torch's fused optimizers decide on the device (no sync): the scaler reads
            # what they decided every REPORT_EVERY iterations.
            for step in range(stall.REPORT_EVERY):
                _step(model, scaler, optimizer, WARMUP + BURST + CLEAN + step, poison=False)
    assert moved_at is not None and moved_at < CLEAN
    stalls = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(stalls) == 1, [str(w.message) for w in stalls]
    assert "on_stall='recover'" in str(stalls[0].message)
    if not fused:
        assert "all gradients zero" in str(stalls[0].message)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_warn_mode_keeps_torchs_scale_and_warns_once() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = amped.GradScaler("cpu", on_stall="warn")
    _burst(model, scaler, optimizer)
    before = _params(model)
    with pytest.warns(RuntimeWarning, match="all gradients zero") as caught:
        for step in range(CLEAN):
            _step(model, scaler, optimizer, WARMUP + BURST + step, poison=False)
    assert len([w for w in caught if "amped.GradScaler" in str(w.message)]) == 1
    assert not _moved(before, model)  # the stall itself, now reported
    assert scaler.get_scale() == SCALE_FLOOR


def test_raise_mode_raises_at_the_floor_before_stepping() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = amped.GradScaler("cpu", on_stall="raise")
    for step in range(WARMUP):
        _step(model, scaler, optimizer, step, poison=False)
    before = _params(model)
    # Each overflow halves the scale 2**e: the floor 2**-126 is reached after e + 126.
    floor_at = WARMUP + int(math.log2(scaler.get_scale())) + 126
    with pytest.raises(ScaleStallError, match=rf"iteration {floor_at} overflowed"):
        for step in range(WARMUP, WARMUP + BURST):
            _step(model, scaler, optimizer, step, poison=True)
    assert step == floor_at
    assert not _moved(before, model)


def test_zero_gradients_with_a_finite_loss_warn_without_a_burst() -> None:
    param = torch.ones(3, requires_grad=True)
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = amped.GradScaler("cpu")
    with pytest.warns(RuntimeWarning, match="all gradients zero") as caught:
        for _ in range(3):
            optimizer.zero_grad()
            scaler.scale(param.sum() * 0.0 + 2.0).backward()
            scaler.step(optimizer)
            scaler.update()
    assert len(caught) == 1
    assert scaler.get_scale() == 2.0**16  # nothing to recover: no clean scale was higher


@pytest.mark.parametrize(
    "loss_value", [0.0, math.nan], ids=["zero-loss", "nan-loss-is-an-overflow"]
)
def test_no_stall_reported_for_a_zero_or_non_finite_loss(loss_value: float) -> None:
    param = torch.ones(3, requires_grad=True)
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = amped.GradScaler("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.zero_grad()
        scaler.scale(param.sum() * 0.0 + loss_value).backward()
        scaler.step(optimizer)
        scaler.update()


def test_default_scaler_matches_torch_bitwise_through_single_overflows() -> None:
    """Where torch's rule is sound (isolated overflows, no stall) amped's scale is torch's."""
    runs = {}
    for name, scaler in [
        ("amped", amped.GradScaler("cpu", growth_interval=3)),
        ("torch", torch.amp.GradScaler("cpu", growth_interval=3)),
    ]:
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scales = []
        for step in range(30):
            _step(model, scaler, optimizer, step, poison=step % 7 == 3)
            scales.append(scaler.get_scale())
        runs[name] = (scales, _params(model))
    assert runs["amped"][0] == runs["torch"][0]
    assert all(torch.equal(a, t) for a, t in zip(runs["amped"][1], runs["torch"][1], strict=True))


def test_recovery_survives_pickling() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = amped.GradScaler("cpu")
    _burst(model, scaler, optimizer)
    scaler = pickle.loads(pickle.dumps(scaler))
    before = _params(model)
    with pytest.warns(RuntimeWarning, match="all gradients zero"):
        for step in range(3):
            _step(model, scaler, optimizer, WARMUP + BURST + step, poison=False)
    assert _moved(before, model)
    assert scaler.get_scale() > 1.0


def test_bad_on_stall_is_refused() -> None:
    with pytest.raises(ValueError, match="on_stall must be 'recover'"):
        amped.GradScaler("cpu", on_stall="ignore")


# --- the steps that unscale inside the optimizer, in every on_stall mode ---------------


def _run_burst_then_clean(run_step, model_params) -> tuple[int | None, list[str]]:
    """Warm up, a 200-step NaN burst, then up to 50 clean steps: the clean step at which a
    parameter first moved (None if none did), and the scaler's stall warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(WARMUP):
            run_step(step, False)
        for step in range(WARMUP, WARMUP + BURST):
            run_step(step, True)
        before = [p.detach().clone() for p in model_params()]
        moved_at = None
        for step in range(CLEAN):
            run_step(WARMUP + BURST + step, False)
            if any(not torch.equal(b, p) for b, p in zip(before, model_params(), strict=True)):
                moved_at = step
                break
    stalls = [str(w.message) for w in caught if "amped.GradScaler" in str(w.message)]
    return moved_at, stalls


def _master_setup(kind: str, on_stall: str) -> amped.recipes.TrainSetup:
    model = _model()
    params = model.parameters()
    optimizer = {
        "sgd": lambda: torch.optim.SGD(params, lr=0.1),
        "adam": lambda: torch.optim.Adam(params, lr=1e-3),
        "adamw": lambda: torch.optim.AdamW(params, lr=1e-3),
    }[kind]()
    scaler = amped.GradScaler("cpu", on_stall=on_stall)
    return amped.prepare(model, optimizer, "fp16-master", scaler=scaler)


def _setup_step(setup):
    def run_step(step: int, poison: bool) -> None:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        with setup.autocast():
            loss = (setup.model(x).float() - 1.0).pow(2).mean()
        setup.backward(loss * math.nan if poison else loss)
        setup.step()
        setup.zero_grad()

    return run_step


@pytest.mark.slow  # 255 steps of the fused master step: about 5 s each
@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_fp16_master_fused_step_recovers_with_one_warning(kind: str) -> None:
    setup = _master_setup(kind, "recover")
    moved_at, stalls = _run_burst_then_clean(_setup_step(setup), setup.model.parameters)
    assert moved_at is not None, "the weights never moved after the burst"
    assert len(stalls) == 1 and "on_stall='recover'" in stalls[0], stalls
    assert all(torch.isfinite(p).all() for p in setup.model.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_fp16_master_fused_step_warns_once_in_warn_mode(kind: str) -> None:
    setup = _master_setup(kind, "warn")
    _, stalls = _run_burst_then_clean(_setup_step(setup), setup.model.parameters)
    assert len(stalls) == 1 and "on_stall='warn'" in stalls[0], stalls
    assert setup.scaler.get_scale() < 1.0  # the strategy's scale, kept


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_fp16_master_fused_step_raises_in_raise_mode(kind: str) -> None:
    setup = _master_setup(kind, "raise")
    with pytest.raises(ScaleStallError, match="overflowed at the scale floor"):
        _run_burst_then_clean(_setup_step(setup), setup.model.parameters)


def _fused_adam_step(on_stall: str):
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), fused=True)
    scaler = amped.GradScaler("cpu", on_stall=on_stall)
    return model, lambda step, poison: _step(model, scaler, optimizer, step, poison), scaler


@pytest.mark.slow  # fast: the warn case without fused Adam, and fused Adam raising
def test_torch_fused_adam_warns_once_in_warn_mode() -> None:
    model, run_step, scaler = _fused_adam_step("warn")
    _, stalls = _run_burst_then_clean(run_step, model.parameters)
    assert len(stalls) == 1 and "on_stall='warn'" in stalls[0], stalls
    assert scaler.get_scale() == SCALE_FLOOR


def test_torch_fused_adam_raises_in_raise_mode() -> None:
    model, run_step, _ = _fused_adam_step("raise")
    with pytest.raises(ScaleStallError, match="overflowed at the scale floor"):
        _run_burst_then_clean(run_step, model.parameters)


# --- a partial stall: float32 gradients survive the floor, float16 ones do not -------


def _head_in_fp32_setup(on_stall: str) -> amped.recipes.TrainSetup:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    policy = amped.Policy.preset("torch", "cpu").with_module("2", "fp32")  # the head
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = amped.GradScaler("cpu", on_stall=on_stall)
    return amped.prepare(model, optimizer, "fp16-mixed", policy=policy, scaler=scaler)


def test_partial_stall_with_a_float32_head_recovers_within_50_steps_with_one_warning() -> None:
    setup = _head_in_fp32_setup("recover")
    body = setup.model[0].weight
    moved_at, stalls = _run_burst_then_clean(_setup_step(setup), lambda: [body])
    assert moved_at is not None and moved_at < CLEAN, "the float16 body never trained"
    assert len(stalls) == 1 and "underflow to zero" in stalls[0], stalls
    assert setup.scaler.get_scale() > 1.0


@pytest.mark.slow  # the fast subset keeps the recovering case
def test_partial_stall_is_reported_in_warn_mode() -> None:
    setup = _head_in_fp32_setup("warn")
    body = setup.model[0].weight
    moved_at, stalls = _run_burst_then_clean(_setup_step(setup), lambda: [body])
    assert moved_at is None  # the stall itself, now reported
    assert len(stalls) == 1 and "on_stall='warn'" in stalls[0], stalls


def test_a_parameter_the_loss_never_reaches_is_no_stall() -> None:
    """A gradient that was zero at the last clean step too (a parameter outside the loss)
    does not make a stall, whatever the scale does."""
    torch.manual_seed(0)
    used, unused = nn.Linear(8, 1), nn.Linear(8, 1)
    optimizer = torch.optim.SGD([*used.parameters(), *unused.parameters()], lr=0.1)
    scaler = amped.GradScaler("cpu", init_scale=2.0**20, growth_interval=3, on_stall="raise")
    for step in range(40):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        with amped.autocast("cpu", dtype=torch.float16):
            loss = used(x).float().pow(2).mean() + 0.0 * unused(x).float().sum()
        # An isolated overflow now and then: the scale drops below the last clean one.
        scaler.scale(loss * (math.inf if step % 9 == 4 else 1.0)).backward()
        scaler.step(optimizer)
        scaler.update()
    assert scaler.get_scale() >= 1.0


def test_a_recovered_scale_that_overflows_is_not_retried() -> None:
    """A gradient that went to zero for good (here: a branch the loss stops using) looks
    like a partial stall whenever the scale is below the last clean one. If that clean
    scale now overflows, recovering to it again and again would skip every step; it
    is demoted instead, and training resumes at the strategy's next scale."""
    torch.manual_seed(0)
    main, branch = nn.Linear(8, 1), nn.Linear(8, 1)
    optimizer = torch.optim.SGD([*main.parameters(), *branch.parameters()], lr=0.1)
    scaler = amped.GradScaler("cpu", init_scale=512.0, growth_interval=10**6)
    stepped = []

    def iteration(step: int, poison: bool, branch_weight: float) -> None:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        with amped.autocast("cpu", dtype=torch.float16):
            out = main(x).float() + branch_weight * branch(x).float()
        loss = out.pow(2).mean()
        scaler.scale(loss * math.nan if poison else loss).backward()
        scaler.step(optimizer)
        scaler.update()
        stepped.append(not scaler.last_step_skipped)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(3):
            iteration(step, False, 1.0)
        for step in range(3, 23):
            iteration(step, True, 0.0)
        # From now on the branch is unused and a scale of 512 overflows.
        for step in range(23, 43):
            iteration(step, scaler.get_scale() >= 512.0, 0.0)
    assert scaler.get_scale() == 256.0
    assert all(stepped[-10:]), stepped[23:]
