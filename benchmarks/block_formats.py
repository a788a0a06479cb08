"""Step time of the emulated FP8 and block recipes against bf16-mixed, on one model.

**CPU** (always). A stack of ``--layers`` Linear(d, 4d) -> GELU -> Linear(4d, d) blocks
(d = ``--dim``) and a small head, ``--tokens`` tokens, AdamW, each recipe through
``amped.prepare`` on its own copy of the model (same initial weights). One train step
is forward under ``setup.autocast()``, backward, ``setup.step()`` and ``zero_grad``.
Recipes run in one process, interleaved one step at a time with the order rotating
every repeat; the printed figure is the median over repeats of
``time(recipe) / time(bf16-mixed)`` (target <= 1.5 on an AVX512-BF16/AMX CPU), once
with one thread and once with all of them (``--threads``). Every recipe except
bf16-mixed runs its GEMMs emulated (no FP8 or block GEMM on a CPU); the block recipes'
casts run compiled (amped.lowp.float8.compiled_cast: compiled in the warm-up step, not timed),
and ``--eager-casts`` adds each block recipe with its casts run eagerly (the same bits).

**GPU** (sm100-class, compute capability 10.x, only; skipped with a line elsewhere):
:func:`run_gpu` times mxfp8, mxfp4 and nvfp4 with native block GEMMs
(``torch._scaled_mm``) against bf16-mixed on large layers (target >= 1.5x). Called by
``benchmarks/fp8.py``'s GPU part, so ``benchmarks/gpu_check.sh`` runs it.

Usage: python benchmarks/block_formats.py [--repeats 7] [--steps 2] [--dim 512]
                                          [--layers 2] [--tokens 2048] [--threads 1,0]
                                          [--recipes fp8-tensorwise,fp8-rowwise,mxfp8,nvfp4]
                                          [--compile] [--eager-casts]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn as nn

import amped
from amped._internal import testing
from amped.comparison.environment import cpu_name

RECIPES = ("fp8-tensorwise", "fp8-rowwise", "mxfp8", "mxfp4", "nvfp4")


def stack(dim: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)]
    return nn.Sequential(*blocks, nn.Linear(dim, 16))


def stepper(
    model: nn.Module, recipe: str, x: torch.Tensor, compile: bool = False, eager_casts: bool = False
) -> Callable[[], None]:
    """One train step of ``recipe``; ``eager_casts``: its block casts run eagerly (the
    same bits, uncompiled: what the step cost before amped.lowp.float8.compiled_cast)."""
    model = copy.deepcopy(model).to(x.device)
    setup = amped.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4), recipe)
    forward = torch.compile(setup.model) if compile else setup.model

    def step() -> None:
        with setup.autocast():
            loss = forward(x).float().pow(2).mean()
        setup.backward(loss)
        setup.step()
        setup.zero_grad()

    def eager_step() -> None:
        with testing.casts("eager"):
            step()

    return eager_step if eager_casts else step


def interleaved(
    steps: dict[str, Callable[[], None]], repeats: int, n: int, sync: Callable[[], None]
) -> dict[str, list[float]]:
    """Per repeat, each variant's time for ``n`` steps, variants rotating order."""
    names = list(steps)
    for name in names:  # warm-up
        steps[name]()
    sync()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            began = time.perf_counter()
            for _ in range(n):
                steps[name]()
            sync()
            times[name].append(time.perf_counter() - began)
    return times


def ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))


def run_cpu(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    base = stack(args.dim, args.layers)
    x = torch.randn(args.tokens, args.dim)
    figures: dict[str, dict[str, float]] = {}
    print(f"CPU: {cpu_name()}, {os.cpu_count()} logical CPUs; load {os.getloadavg()}")
    d = args.dim
    print(
        f"model: {args.layers} x [Linear({d},{4 * d}) GELU Linear({4 * d},{d})] + head, "
        f"{args.tokens} tokens, AdamW; median of {args.repeats} repeats of {args.steps} steps"
        + ("; every model under torch.compile" if args.compile else "; eager")
    )
    for threads in args.threads:
        torch.set_num_threads(threads or os.cpu_count() or 1)
        variants = {"bf16-mixed": stepper(base, "bf16-mixed", x, args.compile)}
        variants |= {name: stepper(base, name, x, args.compile) for name in args.recipes}
        if args.eager_casts:
            variants |= {
                f"{name} (eager casts)": stepper(base, name, x, args.compile, eager_casts=True)
                for name in args.recipes
                if name not in ("fp8-tensorwise", "fp8-rowwise")  # always eager
            }
        times = interleaved(variants, args.repeats, args.steps, lambda: None)
        ms = statistics.median(times["bf16-mixed"]) / args.steps * 1e3
        print(f"{torch.get_num_threads()} thread(s): bf16-mixed {ms:.1f} ms/step")
        for name in [v for v in variants if v != "bf16-mixed"]:
            figure = ratio(times, name, "bf16-mixed")
            ratios = [a / b for a, b in zip(times[name], times["bf16-mixed"], strict=True)]
            print(
                f"  {name:<26} {figure:6.2f}x bf16-mixed   {'ok' if figure <= 1.5 else 'over 1.5x'}"
                f"   (repeats {min(ratios):.2f}-{max(ratios):.2f}x)"
            )
            figures.setdefault(name, {})[f"threads={torch.get_num_threads()}"] = figure
    print(f"load after: {os.getloadavg()}")
    return figures


def run_gpu(
    dim: int = 8192, layers: int = 2, tokens: int = 16384, repeats: int = 5, steps: int = 3
) -> dict[str, float] | None:
    """Native block recipes vs bf16-mixed on an sm100 GPU: speed-ups by recipe, or None
    (and a line) where there is none."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 10:
        print("GPU block formats: skipped (no sm100-class GPU, compute capability 10.x)")
        return None
    base = stack(dim, layers)
    x = torch.randn(tokens, dim, device="cuda")
    variants = {name: stepper(base, name, x) for name in ("bf16-mixed", "mxfp8", "mxfp4", "nvfp4")}
    times = interleaved(variants, repeats, steps, torch.cuda.synchronize)
    speedups = {name: 1 / ratio(times, name, "bf16-mixed") for name in ("mxfp8", "mxfp4", "nvfp4")}
    for name, speedup in speedups.items():
        print(f"{name:<8} native speed-up over bf16-mixed {speedup:.2f}x (target >= 1.5x)")
    return speedups


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--threads", default="1,0", help="comma-separated; 0: all")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--compile", action="store_true", help="torch.compile every model")
    parser.add_argument(
        "--eager-casts",
        action="store_true",
        help="also time each block recipe with its casts uncompiled (before/after)",
    )
    args = parser.parse_args()
    args.threads = [int(t) for t in args.threads.split(",")]
    args.recipes = args.recipes.split(",")
    run_cpu(args)
    run_gpu()


if __name__ == "__main__":
    main()
