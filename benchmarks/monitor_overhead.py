"""Overhead of ``amped.monitor(setup, every=50)`` on the FP8 and block recipes' step.

Two setups of each FP8 and block (mxfp8, mxfp4, nvfp4) recipe, one monitored and one
not, from the same weights, run side by side in one process: one training step of
each, interleaved (order alternating), over ``--steps`` steps per repeat; a repeat's
time is the sum of its step times, and the printed ratio is the median over
``--repeats`` repeats. The model is a stack of ``--layers`` square Linear layers
(``--dim``) with GELUs and a head, in bfloat16 autocast; the monitor samples its
counters every ``--every`` steps and checks its flags (one sync) every step.

Usage: python benchmarks/monitor_overhead.py [--threads 1] [--repeats 7] [--steps 100]
                                             [--dim 512] [--layers 4] [--every 50]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import amped
from amped.recipes.fp8 import BLOCK_RECIPE_NAMES, FP8_RECIPE_NAMES


def _model(dim: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(dim, dim), nn.GELU()]
    return nn.Sequential(*blocks, nn.Linear(dim, 16))


def _setup(recipe: str, dim: int, layers: int):
    model = _model(dim, layers)
    return amped.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4), recipe)


def _step(setup, x: torch.Tensor) -> float:
    start = time.perf_counter()
    with setup.autocast():
        loss = setup.model(x).float().pow(2).mean()
    setup.backward(loss)
    setup.step()
    setup.zero_grad()
    return time.perf_counter() - start


def measure(recipe: str, args: argparse.Namespace) -> tuple[float, float, float]:
    plain = _setup(recipe, args.dim, args.layers)
    watched = _setup(recipe, args.dim, args.layers)
    health = amped.monitor(watched, every=args.every)
    x = torch.randn(args.batch, args.dim)
    for _ in range(3):  # warm-up, and a sampled step for the monitored one
        _step(plain, x)
        _step(watched, x)
    ratios, plain_times, watched_times = [], [], []
    for repeat in range(args.repeats):
        totals = {"plain": 0.0, "watched": 0.0}
        for step in range(args.steps):
            pair = [("plain", plain), ("watched", watched)]
            if (repeat + step) % 2:
                pair.reverse()
            for name, setup in pair:
                totals[name] += _step(setup, x)
        ratios.append(totals["watched"] / totals["plain"])
        plain_times.append(totals["plain"] / args.steps)
        watched_times.append(totals["watched"] / args.steps)
    assert health.sampled_steps >= args.repeats * args.steps // args.every
    assert health.read(), f"{recipe}: no layer reported"
    return (
        statistics.median(ratios),
        statistics.median(plain_times),
        statistics.median(watched_times),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--recipes", default=",".join(FP8_RECIPE_NAMES + BLOCK_RECIPE_NAMES))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), {args.repeats} repeats x "
        f"{args.steps} steps, batch {args.batch}, {args.layers} x Linear({args.dim}), "
        f"every={args.every}"
    )
    for recipe in args.recipes.split(","):
        ratio, plain, watched = measure(recipe, args)
        print(
            f"{recipe:18s} step: plain {plain * 1e3:7.2f} ms, monitored {watched * 1e3:7.2f} ms, "
            f"ratio monitored/plain = {ratio:.3f}"
        )


if __name__ == "__main__":
    main()
