"""The path a region takes, decided on entry and visible (``current_path``).

``TORCH``: torch's own op rules (the default preset), with or without ``"fp32"`` /
``"skip"`` module rules (module hooks): torch's C++ autocast applies them, no mode goes
on the torch-function stack. ``KERNELS``: op rules the dispatcher can apply. ``MODE``:
``"low"`` module rules, the doctor's :func:`forced_path`, the tests' forced runs. Results are
bitwise torch's on every path (tests/autocast_mode/test_autocast_op_lists.py and
tests/autocast_mode/test_autocast_models.py compare the paths with torch)."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from tolerances import BITWISE
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

import amped
from amped.autocast_mode import current_path
from amped.autocast_mode.engine import forced_path
from amped.autocast_mode.state import Path

CHANGED = amped.Policy.preset("torch", "cpu").with_ops(fp32=["mm"])
WITH_MODULE_RULE = amped.Policy.preset("torch", "cpu").with_module(nn.LayerNorm, "fp32")
WITH_LOW_RULE = amped.Policy.preset("torch", "cpu").with_module(nn.Linear, "low")


def engine_on() -> bool:
    """Whether a mode is on this thread's torch-function stack."""
    return bool(_get_current_function_mode_stack())


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
    ("policy", "path"),
    [
        (CHANGED, Path.KERNELS),
        (WITH_MODULE_RULE, Path.TORCH),
        (amped.Policy.preset("strict", "cpu"), Path.KERNELS),
        (WITH_LOW_RULE, Path.MODE),
    ],
    ids=["changed-rule", "module-rule-fp32", "strict", "module-rule-low"],
)
def test_each_policy_takes_its_path(policy, path):
    region = amped.autocast("cpu", policy=policy)
    with region:
        assert current_path("cpu") is path
        assert engine_on() is (path is Path.MODE)
        assert f"path={path.value}" in repr(region)
    assert current_path("cpu") is None and not engine_on()
    with forced_path(Path.MODE), amped.autocast("cpu", policy=policy):
        assert current_path("cpu") is Path.MODE and engine_on()


def test_strict_equals_torch_on_cuda_so_takes_the_torch_path():
    """CUDA's float32 list is what strict adds everywhere: on CUDA it changes nothing."""
    from amped.autocast_mode.engine import torch_rules_only

    assert torch_rules_only(amped.Policy.preset("strict", "cuda"))
    assert torch_rules_only(amped.Policy.preset("torch", "cuda"))
    assert not torch_rules_only(amped.Policy.preset("strict", "cpu"))


def test_forced_path_forces_the_engine_with_or_without_torch_alongside():
    with forced_path(Path.MODE), amped.autocast("cpu"):
        assert engine_on() and current_path("cpu") is Path.MODE
    with amped.autocast("cpu"):
        assert not engine_on() and current_path("cpu") is Path.TORCH
    with forced_path(Path.MODE, torch_alongside=False), amped.autocast("cpu"):
        assert engine_on()


def test_a_user_mode_does_not_change_the_path():
    class Counting(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    a = torch.randn(4, 4)
    with Counting(), amped.autocast("cpu", policy=CHANGED):
        assert current_path("cpu") is Path.KERNELS
        assert torch.mm(a, a).dtype is torch.float32


def test_forced_path_is_per_thread():
    seen = []

    def worker():
        with amped.autocast("cpu"):
            seen.append(engine_on())

    with forced_path(Path.MODE):
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        with amped.autocast("cpu"):
            seen.append(engine_on())
    assert seen == [False, True]


def test_changed_region_inside_default_one_pushes_the_engine_for_itself():
    a = torch.randn(4, 4)
    with amped.autocast("cpu"):
        assert not engine_on()
        with forced_path(Path.MODE), amped.autocast("cpu", policy=CHANGED):
            assert engine_on()
            assert torch.mm(a, a).dtype is torch.float32  # the inner policy rules
        assert not engine_on()
        assert torch.mm(a, a).dtype is torch.bfloat16
    assert not engine_on()


@pytest.mark.parametrize("path", [Path.KERNELS, Path.MODE], ids=["kernels", "mode"])
def test_default_region_inside_changed_one_applies_torch_rules(path):
    a = torch.randn(4, 4)
    forced = forced_path(Path.MODE) if path is Path.MODE else contextlib.nullcontext()
    with forced, amped.autocast("cpu", policy=CHANGED):
        assert current_path("cpu") is path
        with (
            contextlib.nullcontext() if path is Path.MODE else forced_path(None),
            amped.autocast("cpu"),
        ):
            assert engine_on() is (path is Path.MODE)  # the outer region's mode stays
            assert torch.mm(a, a).dtype is torch.bfloat16  # with the inner region's rules
        assert torch.mm(a, a).dtype is torch.float32
    assert not engine_on()


def test_exception_in_nested_regions_leaves_no_engine_behind():
    with (
        pytest.raises(ZeroDivisionError),
        forced_path(Path.MODE),
        amped.autocast("cpu"),
        amped.autocast("cpu", policy=CHANGED),
        amped.autocast("cpu"),
    ):
        raise ZeroDivisionError
    assert not engine_on()
    assert current_path("cpu") is None
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
        with forced_path(Path.MODE) if forced else contextlib.nullcontext():
            got = step(amped.autocast("cpu", dtype=dtype))
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, **BITWISE)
