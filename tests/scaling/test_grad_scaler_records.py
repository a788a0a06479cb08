"""Host-device syncs per step (one at most), and the per-update records that ride on it."""

from __future__ import annotations

import math

import pytest
import torch
from scaler_helpers import count_host_syncs

import amped
from amped.scaling import records, stall
from amped.scaling.records import ScaleRecord

CONFIGS = {
    "default": {},
    "hysteresis": dict(hysteresis=2),
    "bounds": dict(min_scale=1.0, max_scale=2.0**20),
    "static": dict(dynamic=False),
    "history": dict(record_history=True),
    "everything": dict(hysteresis=3, min_scale=1.0, max_scale=2.0**24, record_history=True),
}


def iteration(scaler, optimizers, param, overflow: bool, *, unscale_first: bool = False):
    for optimizer in optimizers:
        optimizer.zero_grad()
    scaler.scale((param * (math.inf if overflow else 1.0)).sum()).backward()
    with count_host_syncs() as syncs:
        for optimizer in optimizers:
            if unscale_first:
                scaler.unscale_(optimizer)
            scaler.step(optimizer)
        scaler.update()
    return syncs


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("unscale_first", [False, True], ids=["step", "unscale-then-step"])
def test_one_sync_per_optimizer_step(config, unscale_first: bool) -> None:
    param = torch.zeros(4, requires_grad=True)
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = amped.GradScaler("cpu", init_scale=4.0, growth_interval=2, **config)
    for step in range(12):
        syncs = iteration(scaler, [optimizer], param, step % 5 == 1, unscale_first=unscale_first)
        assert len(syncs) == 1, syncs


def test_two_optimizers_sync_once_each() -> None:
    first, second = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    optimizers = [torch.optim.SGD([first], lr=0.1), torch.optim.SGD([second], lr=0.1)]
    scaler = amped.GradScaler("cpu", hysteresis=2, record_history=True)
    param = torch.cat([first, second])
    for step in range(6):
        assert len(iteration(scaler, optimizers, param, step == 2)) == 2


def test_fused_optimizer_steps_without_sync() -> None:
    param = torch.zeros(4, requires_grad=True)
    optimizer = torch.optim.Adam([param], lr=0.1, fused=True)
    scaler = amped.GradScaler("cpu", hysteresis=2)
    for step in range(6):
        assert iteration(scaler, [optimizer], param, step == 3) == []
    assert scaler.last_step_skipped is False  # read on demand: this one syncs


def test_fused_optimizer_stall_count_is_read_once_per_report_interval() -> None:
    """Under on_stall="recover" the device handles a fused optimizer's stalls alone; the
    host reads their count (to warn) once every REPORT_EVERY updates, and never else."""
    param = torch.zeros(4, requires_grad=True)
    optimizer = torch.optim.Adam([param], lr=0.1, fused=True)
    scaler = amped.GradScaler("cpu")
    every = stall.REPORT_EVERY
    counts = [len(iteration(scaler, [optimizer], param, step == 3)) for step in range(2 * every)]
    assert counts == [1 if (step + 1) % every == 0 else 0 for step in range(2 * every)]


def test_fused_optimizer_history_flushes_within_the_sync_budget(monkeypatch) -> None:
    monkeypatch.setattr(records, "FLUSH_AT", 4)
    param = torch.zeros(4, requires_grad=True)
    optimizer = torch.optim.Adam([param], lr=0.1, fused=True)
    scaler = amped.GradScaler("cpu", record_history=True)
    for step in range(10):
        assert len(iteration(scaler, [optimizer], param, step == 5)) <= 1
    history = scaler.history
    assert [record.step for record in history] == list(range(10))
    assert [record.step_skipped for record in history] == [step == 5 for step in range(10)]


def test_history_records_each_update() -> None:
    param = torch.zeros(4, requires_grad=True)
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = amped.GradScaler(
        "cpu", init_scale=8.0, growth_interval=2, hysteresis=2, record_history=True
    )
    flags = [False, False, True, True, False]
    for overflow in flags:
        iteration(scaler, [optimizer], param, overflow)
    assert scaler.history == [
        ScaleRecord(0, 8.0, False, False, 8.0, 1, 0),
        ScaleRecord(1, 8.0, False, False, 16.0, 0, 0),
        ScaleRecord(2, 16.0, True, True, 16.0, 0, 1),
        ScaleRecord(3, 16.0, True, True, 8.0, 0, 2),
        ScaleRecord(4, 8.0, False, False, 8.0, 1, 0),
    ]


def test_history_arrives_with_the_next_step_sync() -> None:
    param = torch.zeros(4, requires_grad=True)
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = amped.GradScaler("cpu", record_history=True)
    for overflow in (False, True, False):
        iteration(scaler, [optimizer], param, overflow)
    # The first two records came along with the steps' own syncs; the latest waits.
    with count_host_syncs() as syncs:
        history = scaler.history
    assert len(syncs) == 1 and len(history) == 3
    with count_host_syncs() as syncs:
        assert scaler.history == history
    assert syncs == []


def test_history_of_a_manual_scale() -> None:
    param = torch.zeros(4, requires_grad=True)
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = amped.GradScaler("cpu", init_scale=8.0, record_history=True)
    scaler.scale(param.sum()).backward()
    scaler.step(optimizer)
    scaler.update(new_scale=3.0)
    (record,) = scaler.history
    assert (record.scale, record.new_scale, record.found_inf) == (8.0, 3.0, False)
