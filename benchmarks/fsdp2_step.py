"""The bf16-pure optimizers' step on FSDP2 shards against the same step on plain
parameters, CPU, one process (a gloo group of one rank, so the shards are whole
tensors and only the sharded code path differs).

Sides, each a 4-layer MLP (1024 x 1024 Linear layers, 4.2 M parameters) with the same
fixed gradients, stepped side by side, interleaved one step at a time (the order
rotating every repeat); the printed ratio is the median over repeats of
``time(sharded) / time(plain)``:

- ``plain-eager``: the recipe's optimizer on plain parameters with ``fused=False``;
- ``sharded``: the same on ``fully_shard``-ed parameters (DTensors: the shard
  bookkeeping of amped.optim.shards and sharded_state on top);
- with ``--fused``, ``plain-fused`` and ``sharded-fused``: the default step (fused
  where it can be: bf16-pure's on shards too, bf16-pure-8bit's on plain parameters
  only), compiled during the warm-up steps.

Usage: python benchmarks/fsdp2_step.py [--recipes bf16-pure bf16-pure-8bit]
                                       [--repeats 9] [--threads 1] [--fused]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import amped


def build(recipe: str, sharded: bool, fused: bool | None) -> amped.TrainSetup:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
    if sharded:
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    setup = amped.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), recipe)
    setup.optimizer.fused = fused
    with setup.autocast():
        loss = setup.model(torch.randn(8, 1024)).float().pow(2).mean()
    setup.backward(loss)  # the gradients stay: every timed step reads them
    return setup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--recipes", nargs="+", default=["bf16-pure", "bf16-pure-8bit"])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fused", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for recipe in args.recipes:
            sides = {
                "plain-eager": build(recipe, False, False),
                "sharded": build(recipe, True, False),
            }
            if args.fused:
                sides["plain-fused"] = build(recipe, sharded=False, fused=None)
                sides["sharded-fused"] = build(recipe, sharded=True, fused=None)
            for setup in sides.values():  # warm-up (compiles the fused step)
                setup.optimizer.step()
            times: dict[str, list[float]] = {name: [] for name in sides}
            names = list(sides)
            for repeat in range(args.repeats):
                for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                    start = time.perf_counter()
                    sides[name].optimizer.step()
                    times[name].append(time.perf_counter() - start)
            base = times["plain-eager"]
            for name in names:
                ratio = statistics.median(t / b for t, b in zip(times[name], base, strict=True))
                median = statistics.median(times[name]) * 1e3
                label = f"{recipe:16s} {name:12s} {median:8.1f} ms"
                print(f"{label}  ratio {name}/plain-eager = {ratio:.2f}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
