"""A training step with FP8 weights on the FSDP2 wire against the same step all-gathering
bfloat16, 2 gloo processes on this machine (CPU).

Both sides are ``fp8-tensorwise`` on ``bf16-pure``, a 4-layer MLP of 1024 x 1024 Linear
layers (each and the root ``fully_shard``ed), the same batch; they differ only in what
FSDP2 all-gathers: ``wire`` sends FP8 bytes (each rank casts its rows with the
all-reduced amax's scale), ``bf16`` has the wire taken off (each rank sends bfloat16
rows and the layer casts the gathered weight). Steps alternate between the sides (the
order rotating every repeat); rank 0 prints the bytes each side all-gathers per step
and the median over repeats of ``time(wire) / time(bf16)``. On CPUs the all-gather is
a copy over loopback, so the ratio shows what the wire costs (the shards' cast and one
small all-reduce per layer and all-gather), not what it saves on a network.

Usage: python benchmarks/fsdp2_fp8_wire.py [--repeats 7] [--steps 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import amped
from amped._internal.torch_compat import (
    dtensor_local,
    fsdp_reset_sharded_params,
    set_dtensor_local,
)
from amped.lowp.convert import convert_layers
from amped.lowp.float8.config import FLOAT8_CONFIGS
from amped.optim.shards import fsdp_modules

WIDTH, LAYERS, BATCH = 1024, 4, 64


def build(wire: bool) -> amped.TrainSetup:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    convert_layers(model, FLOAT8_CONFIGS["tensorwise"], [str(i) for i in range(LAYERS)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    setup = amped.prepare(model, optimizer, "fp8-tensorwise", base="bf16-pure")
    if not wire:  # plain local tensors: FSDP2 all-gathers them as they are
        for layer in model:
            set_dtensor_local(layer.weight, dtensor_local(layer.weight).as_subclass(torch.Tensor))
        for module in fsdp_modules(model):
            fsdp_reset_sharded_params(module)
    return setup


def step(setup: amped.TrainSetup, x: torch.Tensor) -> None:
    with setup.autocast():
        loss = setup.model(x).float().pow(2).mean()
    setup.backward(loss)
    setup.step()
    setup.zero_grad()


def gathered_bytes(setup: amped.TrainSetup, x: torch.Tensor) -> int:
    counted = [0]
    original = dist.all_gather_single

    def counting(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counted[0] += input.numel() * input.element_size()
        return original(output, input, *args, **kwargs)

    dist.all_gather_single = counting  # type: ignore[assignment]
    try:
        step(setup, x)
    finally:
        dist.all_gather_single = original  # type: ignore[assignment]
    return counted[0]


def run(rank: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    try:
        sides = {"wire": build(wire=True), "bf16": build(wire=False)}
        x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(rank))
        wire_bytes = {name: gathered_bytes(setup, x) for name, setup in sides.items()}  # warm-up
        times: dict[str, list[float]] = {name: [] for name in sides}
        order = list(sides)
        for repeat in range(args.repeats):
            for name in order[repeat % 2 :] + order[: repeat % 2]:
                dist.barrier()
                start = time.perf_counter()
                for _ in range(args.steps):
                    step(sides[name], x)
                times[name].append((time.perf_counter() - start) / args.steps)
        if rank == 0:
            for name in sides:
                ms = statistics.median(times[name]) * 1e3
                print(f"{name:5s} all-gathers {wire_bytes[name]:>10,d} B/step/rank, {ms:.1f} ms")
            ratios = [w / b for w, b in zip(times["wire"], times["bf16"], strict=True)]
            print(f"ratio wire/bf16 = {statistics.median(ratios):.2f} (median of {args.repeats})")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(run, args=(port, args), nprocs=2)


if __name__ == "__main__":
    main()
