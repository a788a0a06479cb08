"""Region bookkeeping by identity: regions held across ``yield``/``await`` and exited out
of order each undo exactly what they changed.

While several regions are open on a thread, the innermost one still open is in force
(its policy, its dtype), whichever order the others were opened and closed in; after
all of them, torch's state and amped's are as before (the autouse fixture checks that).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn as nn

import amped
from amped.autocast_mode import current_path

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
_TORCH = amped.Policy.preset("torch", "cpu")
MM_FP32 = _TORCH.with_ops(fp32=["mm"])
MM_KEEP = _TORCH.with_ops(keep=["mm"])
A, B = torch.randn(4, 4), torch.randn(4, 4)


def in_force() -> tuple[amped.Policy | None, bool, torch.dtype, torch.dtype]:
    """The active policy, torch's autocast state, and what mm really does now."""
    return (
        amped.current_policy("cpu"),
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch.mm(A.to(FP16), B.to(FP16)).dtype if torch.is_autocast_enabled("cpu") else FP32,
    )


def region_gen(policy, dtype):
    with amped.autocast("cpu", dtype=dtype, policy=policy):
        yield in_force()
        yield in_force()


@pytest.mark.parametrize("order", ["first-exits-first", "last-exits-first"])
def test_generators_exited_out_of_order(order):
    before = in_force()
    g1, g2 = region_gen(MM_FP32, BF16), region_gen(MM_KEEP, FP16)
    assert next(g1) == (MM_FP32, True, BF16, FP32)  # mm listed fp32
    assert next(g2) == (MM_KEEP, True, FP16, FP16)  # mm kept: runs on its fp16 inputs
    first, second = (g1, g2) if order == "first-exits-first" else (g2, g1)
    next(first)
    with pytest.raises(StopIteration):
        next(first)  # exits its region while the other is still open
    policy, enabled, dtype, mm = in_force()
    remaining = MM_KEEP if first is g1 else MM_FP32
    assert policy is remaining and enabled
    assert dtype == (FP16 if remaining is MM_KEEP else BF16)
    assert mm == (FP16 if remaining is MM_KEEP else FP32)
    next(second)
    with pytest.raises(StopIteration):
        next(second)
    assert in_force() == before
    assert current_path("cpu") is None


def test_disabled_region_exited_before_the_enabled_one_inside_it():
    before = in_force()
    outer = amped.autocast("cpu", enabled=False)
    inner = amped.autocast("cpu", policy=MM_FP32)
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)  # out of order: inner is still open and in force
    assert in_force() == (MM_FP32, True, BF16, FP32)
    inner.__exit__(None, None, None)
    assert in_force() == before


def test_asyncio_tasks_interleaved():
    seen: dict[str, list[object]] = {"a": [], "b": []}
    gate_a, gate_b = asyncio.Event(), asyncio.Event()

    async def task(name, policy, dtype, wait, release):
        with amped.autocast("cpu", dtype=dtype, policy=policy):
            seen[name].append(in_force())
            release.set()
            await wait.wait()
            seen[name].append(amped.current_policy("cpu"))
        seen[name].append(amped.current_policy("cpu"))
        release.set()

    async def main():
        # a opens, b opens, a closes first (b still open), then b closes
        ta = asyncio.create_task(task("a", MM_FP32, BF16, gate_a, asyncio.Event()))
        await asyncio.sleep(0)
        tb = asyncio.create_task(task("b", MM_KEEP, FP16, gate_b, gate_a))
        await ta
        assert amped.current_policy("cpu") is MM_KEEP  # b's region is still open
        assert torch.get_autocast_dtype("cpu") == FP16
        gate_b.set()
        await tb

    before = in_force()
    asyncio.run(main())
    assert seen["a"][0] == (MM_FP32, True, BF16, FP32)
    assert seen["b"][0] == (MM_KEEP, True, FP16, FP16)
    assert seen["a"][2] is MM_KEEP and seen["b"][2] is None
    assert in_force() == before
    assert current_path("cpu") is None


def test_module_rule_region_exited_out_of_order_releases_its_hooks():
    with_rule = _TORCH.with_module(nn.ReLU, "fp32")
    g1, g2 = region_gen(with_rule, BF16), region_gen(MM_FP32, BF16)
    next(g1), next(g2)
    list(g1)  # the region with module rules closes first
    assert amped.current_policy("cpu") is MM_FP32
    relu_out = nn.ReLU()(torch.randn(2, dtype=BF16))
    assert relu_out.dtype == BF16  # the module rule is no longer applied
    list(g2)
    assert current_path("cpu") is None


def test_exiting_twice_is_refused():
    region = amped.autocast("cpu", policy=MM_FP32)
    region.__enter__()
    region.__exit__(None, None, None)
    with pytest.raises(RuntimeError, match="more times than __enter__"):
        region.__exit__(None, None, None)
