"""Where an emulated FP8 train step's time goes, per part, on ``block_formats.py``'s model.

The casts run compiled on amped's cast worker thread (amped.fp8.compiled_cast), where
``torch.profiler`` on the main thread sees no ops, only the self time of the layer's
autograd Functions. So this times every ``compiled_cast.run`` call from the caller
(the kernel, the hand-off to the worker and back), by kernel and operand shape, over
``--steps`` timed steps, and then profiles one more step for the aten ops (GEMMs, the
bias add, GELU, the optimizer) beside them.

Usage: python benchmarks/fp8_parts.py [--recipe fp8-rowwise] [--threads 1] [--steps 5]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time
from typing import Any

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

import amped
from amped.comparison.environment import cpu_name
from amped.fp8 import compiled_cast


def model_and_step(recipe: str, dim: int, layers: int, tokens: int) -> Any:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)]
    model = nn.Sequential(*blocks, nn.Linear(dim, 16))
    x = torch.randn(tokens, dim)
    setup = amped.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4), recipe)

    def step() -> None:
        with setup.autocast():
            loss = setup.model(x).float().pow(2).mean()
        setup.backward(loss)
        setup.step()
        setup.zero_grad()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--recipe", default="fp8-rowwise")
    parser.add_argument("--threads", type=int, default=1, help="0: all")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    step = model_and_step(args.recipe, args.dim, args.layers, args.tokens)
    for _ in range(3):  # compiles the kernels
        step()

    spent: dict[tuple[Any, ...], float] = collections.defaultdict(float)
    calls: dict[tuple[Any, ...], int] = collections.defaultdict(int)
    run = compiled_cast.run

    def timed_run(function: Any, spec: Any, x: torch.Tensor, *rest: Any) -> Any:
        began = time.perf_counter()
        result = run(function, spec, x, *rest)
        key = (function.__name__, str(spec), tuple(x.shape), str(x.dtype).removeprefix("torch."))
        spent[key] += time.perf_counter() - began
        calls[key] += 1
        return result

    compiled_cast.run = timed_run  # type: ignore[assignment]
    steps = []
    try:
        for _ in range(args.steps):
            began = time.perf_counter()
            step()
            steps.append(time.perf_counter() - began)
    finally:
        compiled_cast.run = run  # type: ignore[assignment]

    print(f"CPU: {cpu_name()}; {torch.get_num_threads()} thread(s); load {os.getloadavg()}")
    print(f"{args.recipe}: step {statistics.median(steps) * 1e3:.1f} ms (median of {args.steps})")
    print("compiled_cast.run calls, ms per step (kernel + hand-off), by kernel and operand:")
    for key, seconds in sorted(spent.items(), key=lambda item: -item[1]):
        print(f"  {seconds / args.steps * 1e3:7.2f} ms  {calls[key] // args.steps} x {key}")
    print(f"  {sum(spent.values()) / args.steps * 1e3:7.2f} ms  in all")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
