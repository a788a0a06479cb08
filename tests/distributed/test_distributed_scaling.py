"""The scaler's agreement across ranks, in this process: a gloo group of one rank.

A group of one (over an in-memory store: no sockets are connected) runs every code
path of the agreement but cannot disagree; ``test_distributed.py`` runs 2 processes.
"""

from __future__ import annotations

import math
import pickle
import threading
import time

import pytest
import torch
import torch.distributed as dist
from dist_launch import one_rank_group

import amped
from amped._internal.torch_compat import tensor_use_count
from amped.scaling.checks import ScalerOrderError
from amped.scaling.distributed import (
    agreement_groups,
    check_scaler_agreement,
    gather_objects,
    wait_until_released,
)


@pytest.fixture
def world_of_one():
    with one_rank_group() as group:
        yield group


@pytest.fixture
def all_reduces(monkeypatch) -> list[tuple[float, object]]:
    """Records (value after the reduction, op) of every dist.all_reduce call."""
    calls: list[tuple[float, object]] = []
    original = dist.all_reduce

    def counted(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        work = original(tensor, op=op, group=group, async_op=async_op)
        calls.append((tensor.item(), op))
        return work

    monkeypatch.setattr(dist, "all_reduce", counted)
    return calls


def train(model, scaler, optimizer, steps=3, inf_at=None):
    torch.manual_seed(1)
    for step in range(steps):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        scaler.scale(loss).backward()
        if step == inf_at:
            grad = model.weight.grad
            (grad.to_local() if hasattr(grad, "to_local") else grad)[0, 0] = math.inf
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    return model


def linear() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(8, 4)


def test_process_group_must_be_a_process_group():
    with pytest.raises(TypeError, match=r"Received: process_group='world' \(of type str\)$"):
        amped.GradScaler("cpu", process_group="world")


def test_one_process_makes_no_collective(all_reduces):
    model = linear()
    train(model, amped.GradScaler("cpu"), torch.optim.SGD(model.parameters(), lr=0.1))
    assert all_reduces == []
    assert agreement_groups(None, model.parameters()) == []


def test_plain_gradients_under_a_process_group_need_no_collective(world_of_one, all_reduces):
    # As under DDP: the gradients are plain tensors, already the same on every rank.
    model = linear()
    train(model, amped.GradScaler("cpu"), torch.optim.SGD(model.parameters(), lr=0.1))
    assert all_reduces == []


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-adam"])
def test_an_explicit_group_takes_one_max_all_reduce_per_step(world_of_one, all_reduces, fused):
    def run(group):
        model = linear()
        if fused:
            optimizer = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
        else:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = amped.GradScaler("cpu", init_scale=8.0, process_group=group)
        return train(model, scaler, optimizer, steps=4, inf_at=2), scaler

    agreed, scaler = run(world_of_one)
    assert all_reduces == [(0.0, dist.ReduceOp.MAX)] * 2 + [(1.0, dist.ReduceOp.MAX)] + [
        (0.0, dist.ReduceOp.MAX)
    ]
    assert scaler.get_scale() == 4.0
    alone, _ = run(None)
    torch.testing.assert_close(agreed.weight, alone.weight, rtol=0, atol=0)


def test_a_rank_without_gradients_still_joins_the_collective(world_of_one, all_reduces):
    param = torch.zeros(2, requires_grad=True)
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = amped.GradScaler("cpu", process_group=world_of_one)
    other = torch.ones((), requires_grad=True)
    scaler.scale(other * 2).backward()  # nothing reaches param.grad
    with pytest.raises(ScalerOrderError, match="none of its parameters has a gradient"):
        scaler.step(optimizer)
    assert len(all_reduces) == 1


@pytest.mark.slow  # importing FSDP2 takes seconds
def test_dtensor_gradients_are_found_and_agreed_on(world_of_one, all_reduces):
    from torch.distributed.fsdp import fully_shard

    sharded = linear()
    fully_shard(sharded)
    assert agreement_groups(None, sharded.parameters()) == []  # no gradients yet
    scaler = amped.GradScaler("cpu", init_scale=8.0)
    train(sharded, scaler, torch.optim.SGD(sharded.parameters(), lr=0.1), steps=4, inf_at=1)
    assert [op for _, op in all_reduces] == [dist.ReduceOp.MAX] * 4
    assert [value for value, _ in all_reduces] == [0.0, 1.0, 0.0, 0.0]
    assert scaler.get_scale() == 4.0
    plain = linear()
    train(
        plain,
        amped.GradScaler("cpu", init_scale=8.0),
        torch.optim.SGD(plain.parameters(), lr=0.1),
        steps=4,
        inf_at=1,
    )
    torch.testing.assert_close(sharded.weight.full_tensor(), plain.weight, rtol=0, atol=0)


def test_check_scaler_agreement_returns_the_state(world_of_one):
    model = linear()
    scaler = amped.GradScaler("cpu", init_scale=8.0)
    train(model, scaler, torch.optim.SGD(model.parameters(), lr=0.1), inf_at=0)
    assert check_scaler_agreement(scaler) == scaler.state_dict()


@pytest.mark.parametrize(
    "obj", [{"scale": 8.0, "_growth_tracker": 3}, [], "x" * 10_000, (None, math.inf)]
)
def test_gather_objects_returns_each_rank_s_object(world_of_one, obj):
    assert gather_objects(obj) == [obj]
    assert gather_objects(obj, world_of_one) == [obj]


def test_use_count_counts_the_python_object_and_what_c_plus_plus_holds():
    tensor = torch.zeros(3, requires_grad=True)
    assert tensor_use_count(tensor) == 1  # the Python object alone
    graph = tensor * tensor  # autograd saves `tensor` for the backward
    assert tensor_use_count(tensor) > 1
    del graph
    assert tensor_use_count(tensor) == 1


def test_wait_until_released_waits_for_another_thread_to_let_go():
    tensor = torch.zeros(3, requires_grad=True)
    counts = [tensor_use_count(tensor)]
    holder = {"graph": tensor * tensor}
    released_at: list[float] = []

    def let_go():
        time.sleep(0.05)
        released_at.append(time.monotonic())
        holder.clear()

    thread = threading.Thread(target=let_go)
    thread.start()
    assert wait_until_released([tensor], counts)
    returned_at = time.monotonic()
    thread.join()
    assert tensor_use_count(tensor) == counts[0] and returned_at >= released_at[0]


def test_wait_until_released_gives_up_at_the_deadline():
    tensor = torch.zeros(3, requires_grad=True)
    counts = [tensor_use_count(tensor)]
    graph = tensor * tensor
    assert not wait_until_released([tensor], counts, deadline_s=0.01)
    del graph
    assert wait_until_released([tensor], counts, deadline_s=0.0)


def test_pickling_leaves_the_process_group_behind(world_of_one):
    scaler = amped.GradScaler("cpu", process_group=world_of_one)
    copy = pickle.loads(pickle.dumps(scaler))
    assert copy._process_group is None and scaler._process_group is world_of_one
