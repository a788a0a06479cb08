"""When amped's engine runs, and when a region leaves the casts to torch's C++ autocast.

A policy with exactly torch's op rules and no module rules (the default preset) needs
no engine: torch's C++ autocast, switched on by the region, applies those rules, so no
mode goes on the torch-function stack. Any other policy does; so does every policy
while the tests' TORCH_AUTOCAST_ALONGSIDE switch is off or inside engine_always().
Results are bitwise torch's either way (tests/test_autocast_op_lists.py and
tests/test_autocast_models.py compare both paths with torch)."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import _get_current_function_mode_stack

import amped
from amped.autocast_mode import dispatch, mode, state
from amped.autocast_mode.mode import AutocastMode
from tolerances import BITWISE

CHANGED = amped.Policy.preset("torch", "cpu").with_ops(fp32=["mm"])
WITH_MODULE_RULE = amped.Policy.preset("torch", "cpu").with_module(nn.LayerNorm, "fp32")


def engine_on() -> bool:
    """Whether amped's mode is on this thread's torch-function stack."""
    on_stack = any(isinstance(m, AutocastMode) for m in _get_current_function_mode_stack())
    mode = state._state.mode  # (a parked mode is off the stack: tests/test_autocast_lean.py)
    assert on_stack == (mode is not None and mode.on_stack)
    return on_stack


@pytest.mark.parametrize("preset", ["torch", None])
def test_torch_rules_run_without_the_engine(preset):
    with amped.autocast("cpu", policy=preset):
        assert not engine_on()
        assert torch.is_autocast_enabled("cpu")
        assert amped.current_policy("cpu") == amped.Policy.preset("torch", "cpu")
        a = torch.randn(4, 4)
        assert torch.mm(a, a).dtype is torch.bfloat16  # torch's C++ autocast cast it
    assert not engine_on()


@pytest.mark.parametrize(
    ("policy", "fast"),
    [(CHANGED, True), (WITH_MODULE_RULE, False), (amped.Policy.preset("strict", "cpu"), True)],
    ids=["changed-rule", "module-rule", "strict"],
)
def test_any_other_policy_runs_the_engine_or_the_kernels(policy, fast, monkeypatch):
    # Op rules alone: kernels at the Autocast keys (amped.autocast_mode.dispatch), no mode
    # (until something in the process compiles, as an earlier test file may have).
    # Module rules alone: the mode engine, parked off the stack outside ruled modules.
    dispatch.watch_compiles()  # listening (an earlier test may have reset Dynamo)
    monkeypatch.setattr(dispatch, "compiled_once", False)
    assert state.needs_engine(policy)
    with amped.autocast("cpu", policy=policy):
        assert not engine_on()
        assert state._state.regions[-1].fast is fast
        assert (state._state.mode is not None) is not fast
        if not fast:
            assert state._state.mode.parkable and state._state.regions[-1].engine
    assert not engine_on()
    monkeypatch.setattr(state, "FAST_PATH", False)
    with amped.autocast("cpu", policy=policy):
        assert engine_on()


def test_strict_equals_torch_on_cuda_so_needs_no_engine_there():
    """CUDA's float32 list is what strict adds everywhere: on CUDA it changes nothing."""
    assert not state.needs_engine(amped.Policy.preset("strict", "cuda"))
    assert not state.needs_engine(amped.Policy.preset("torch", "cuda"))


def test_engine_always_and_the_test_switch_force_the_engine(monkeypatch):
    with state.engine_always(), amped.autocast("cpu"):
        assert engine_on()
    with amped.autocast("cpu"):
        assert not engine_on()
    monkeypatch.setattr(mode, "TORCH_AUTOCAST_ALONGSIDE", False)
    with amped.autocast("cpu"):
        assert engine_on()


def test_engine_always_is_per_thread():
    seen = []

    def worker():
        with amped.autocast("cpu"):
            seen.append(engine_on())

    with state.engine_always():
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        with amped.autocast("cpu"):
            seen.append(engine_on())
    assert seen == [False, True]


def test_changed_region_inside_default_one_pushes_the_engine_for_itself(monkeypatch):
    monkeypatch.setattr(state, "FAST_PATH", False)  # the mode engine's nesting
    a = torch.randn(4, 4)
    with amped.autocast("cpu"):
        assert not engine_on()
        with amped.autocast("cpu", policy=CHANGED):
            assert engine_on()
            assert torch.mm(a, a).dtype is torch.float32  # the inner policy rules
        assert not engine_on()
        assert torch.mm(a, a).dtype is torch.bfloat16
    assert not engine_on()


def test_default_region_inside_changed_one_keeps_the_engine_with_torch_rules(monkeypatch):
    monkeypatch.setattr(state, "FAST_PATH", False)  # the mode engine's nesting
    a = torch.randn(4, 4)
    with amped.autocast("cpu", policy=CHANGED):
        with amped.autocast("cpu"):
            assert engine_on()  # the outer region still needs it; it applies torch's rules
            assert torch.mm(a, a).dtype is torch.bfloat16
        assert engine_on()
        assert torch.mm(a, a).dtype is torch.float32
    assert not engine_on()


def test_exception_in_nested_regions_leaves_no_engine_behind(monkeypatch):
    monkeypatch.setattr(state, "FAST_PATH", False)  # the mode engine's nesting
    with (
        pytest.raises(ZeroDivisionError),
        amped.autocast("cpu"),
        amped.autocast("cpu", policy=CHANGED),
        amped.autocast("cpu"),
    ):
        raise ZeroDivisionError
    assert not engine_on()
    assert state._state.regions == []
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_both_paths_match_torch_bitwise_on_a_train_step(dtype):
    """A LayerNorm/GELU/Linear/softmax/cross-entropy step, loss and every gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 5))
    x, y = torch.randn(6, 8), torch.randint(0, 5, (6,))

    def step(region):
        model.zero_grad()
        with region:
            out = model(x).softmax(-1).log()
            loss = F.nll_loss(out.float(), y)
        loss.backward()
        return [loss.detach(), *(p.grad.clone() for p in model.parameters())]

    expected = step(torch.autocast("cpu", dtype=dtype))
    for forced in (False, True):
        with state.engine_always() if forced else contextlib.nullcontext():
            got = step(amped.autocast("cpu", dtype=dtype))
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, **BITWISE)
