"""fp8-delayed under DDP and under FSDP2 on one rank (run by tests/helpers/dist_fsdp2_worker.py,
results read by tests/distributed/test_fp8_distributed.py), each rank on its own data, recording per
step every layer's local amaxes (before the all-reduce), amax history and scales:
:func:`ddp` and :func:`fsdp`."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import amped
from amped.lowp.convert import convert_layers
from amped.lowp.float8.config import FLOAT8_CONFIGS

STEPS = 4


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)
    )


def keep(linear: nn.Linear, name: str) -> bool:
    return name in ("0", "2")


class CountingAllReduce:
    """Counts the Python-level all-reduces (amped's; DDP's reducer and FSDP2 use others)."""

    def __init__(self) -> None:
        self.calls = 0
        self.original = dist.all_reduce

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.original(*args, **kwargs)


def train(model, setup, rank: int) -> dict[str, list]:
    record: dict[str, list] = {"pending": [], "history": [], "scale": [], "loss": [], "reduces": []}
    counter = CountingAllReduce()
    dist.all_reduce = counter  # type: ignore[assignment]
    update = setup.low_precision_layers.update

    def recording_update() -> None:
        layers = setup.low_precision_layers.layers.values()
        record["pending"].append([layer.fp8_pending.clone() for layer in layers])
        update()
        record["history"].append([layer.fp8_amax_history.clone() for layer in layers])
        record["scale"].append([layer.fp8_scale.clone() for layer in layers])

    setup.low_precision_layers.update = recording_update  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data and amaxes
    for _ in range(STEPS):
        x = torch.randn(16, 32, generator=g) * (1 + 3 * rank)
        y = torch.randint(0, 8, (16,), generator=g)
        with setup.autocast():
            loss = F.cross_entropy(model(x), y)
        setup.backward(loss)
        setup.step()
        setup.zero_grad()
        record["loss"].append(loss.item())
        record["reduces"].append(counter.calls)
        counter.calls = 0
    dist.all_reduce = counter.original  # type: ignore[assignment]
    return record


def ddp(rank: int) -> dict[str, list]:
    model = net()
    setup = amped.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1), "fp8-delayed", module_filter=keep
    )
    record = train(DDP(setup.model), setup, rank)
    record["params"] = [p.detach().clone() for p in model.parameters()]
    return record


def fsdp(rank: int) -> dict[str, list]:
    from torch.distributed.fsdp import fully_shard

    model = net()
    convert_layers(model, FLOAT8_CONFIGS["delayed"], ["0", "2"])  # convert, then shard
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    setup = amped.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp8-delayed")
    assert setup.low_precision_layers.names() == ["0", "2"]
    record = train(model, setup, rank)
    record["params"] = [p.full_tensor().detach().clone() for p in model.parameters()]
    return record
