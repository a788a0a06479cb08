"""Overhead of ``amped.monitor(setup, every=50)`` on the FP8 and block recipes' step.

Three setups of each FP8 and block (mxfp8, mxfp4, nvfp4) recipe from the same weights,
one monitored and two not (the second, a *twin* of the first, is the control: two
identical setups differ by a few percent on a loaded machine, from where their memory
lies and what else runs), run side by side in one process: one training step of each,
interleaved (order rotating), over ``--steps`` steps per repeat (a multiple
of ``--every``, so every repeat holds the same number of sampled steps); a repeat's
time is the sum of its step times, and the printed ratios (monitored / plain, and the
control twin / plain) are the median over ``--repeats`` repeats, with the smallest and
largest beside them. Two clocks: wall time
(``perf_counter``) and this process's CPU time (``process_time``), which a machine
shared with other work inflates far less (with one thread the two agree when idle).
The model is a stack of ``--layers`` square Linear layers (``--dim``) with GELUs and a
head, in bfloat16 autocast; the monitor samples its counters every ``--every`` steps
and checks its probes (one sync) every step.

The defaults run all seven recipes in about three minutes on an idle 2-core machine.

With ``--record``, the flight recorder's cost instead: all three setups are monitored,
the measured one with ``record=`` a temporary folder (keeping each GEMM's tensors and
reading the loss in the step's one sync; no bundle is written on a clean step), the
other two without; the ratios are then recording / monitored.

Usage: python benchmarks/monitor_overhead.py [--threads 1] [--repeats 5] [--steps 50]
                                             [--dim 512] [--layers 4] [--every 50]
                                             [--record]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
from torch import nn

import amped
from amped.comparison.environment import cpu_name
from amped.recipes.lowp import BLOCK_RECIPE_NAMES, FP8_RECIPE_NAMES


def _model(dim: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(dim, dim), nn.GELU()]
    return nn.Sequential(*blocks, nn.Linear(dim, 16))


def _setup(recipe: str, dim: int, layers: int):
    model = _model(dim, layers)
    return amped.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4), recipe)


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _step(setup, x: torch.Tensor) -> dict[str, float]:
    start = {name: clock() for name, clock in CLOCKS.items()}
    with setup.autocast():
        loss = setup.model(x).float().pow(2).mean()
    setup.backward(loss)
    setup.step()
    setup.zero_grad()
    return {name: clock() - start[name] for name, clock in CLOCKS.items()}


Result = dict[tuple[str, str], tuple[float, float, float]]


def measure(recipe: str, args: argparse.Namespace) -> tuple[Result, dict[str, float]]:
    """Per (clock, "monitored" or "twin"): (median ratio to plain, smallest, largest);
    and per clock the median plain step in seconds."""
    setups = {who: _setup(recipe, args.dim, args.layers) for who in ("plain", "twin", "watched")}
    folder = tempfile.mkdtemp(prefix="amped-record-") if args.record else None
    health = amped.monitor(setups["watched"], every=args.every, record=folder)
    if args.record:  # the baseline is the monitor without recording
        for who in ("plain", "twin"):
            amped.monitor(setups[who], every=args.every)
    x = torch.randn(args.batch, args.dim)
    for _ in range(3):  # warm-up, and a sampled step for the monitored one
        for setup in setups.values():
            _step(setup, x)
    ratios: dict[tuple[str, str], list[float]] = {}
    plain_steps: dict[str, list[float]] = {name: [] for name in CLOCKS}
    order = list(setups)
    for repeat in range(args.repeats):
        totals = {(who, name): 0.0 for who in setups for name in CLOCKS}
        for step in range(args.steps):
            shift = (repeat + step) % len(order)  # each setup runs first, second, third
            for who in order[shift:] + order[:shift]:
                for name, seconds in _step(setups[who], x).items():
                    totals[who, name] += seconds
        for name in CLOCKS:
            for who, label in (("watched", "monitored"), ("twin", "twin")):
                ratio = totals[who, name] / totals["plain", name]
                ratios.setdefault((name, label), []).append(ratio)
            plain_steps[name].append(totals["plain", name] / args.steps)
    if health.sampled_steps < args.repeats * args.steps // args.every:
        raise RuntimeError(f"{recipe}: the monitor sampled {health.sampled_steps} steps")
    if not health.read():
        raise RuntimeError(f"{recipe}: no layer reported to the monitor")
    if health.recorder is not None and health.recorder.bundles:
        raise RuntimeError(f"{recipe}: a clean run wrote {health.recorder.bundles}")
    spread = {key: (statistics.median(v), min(v), max(v)) for key, v in ratios.items()}
    return spread, {name: statistics.median(v) for name, v in plain_steps.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--recipes", default=",".join(FP8_RECIPE_NAMES + BLOCK_RECIPE_NAMES))
    parser.add_argument("--record", action="store_true", help="recording / monitored instead")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.steps % args.every:
        parser.error(f"--steps ({args.steps}) must be a multiple of --every ({args.every})")
    print(
        f"{cpu_name()}, {os.cpu_count()} logical CPUs; "
        f"torch {torch.__version__}, {args.threads} thread(s), {args.repeats} repeats x "
        f"{args.steps} steps, batch {args.batch}, {args.layers} x Linear({args.dim}), "
        f"every={args.every}; ratios: median [min-max] over repeats; twin: the "
        f"{'monitored, not recording' if args.record else 'unmonitored'} control's ratio "
        "(the noise floor)"
    )
    for recipe in args.recipes.split(","):
        ratios, plain = measure(recipe, args)
        parts = [
            f"{name} {ratio:.3f} [{low:.3f}-{high:.3f}] (twin {ratios[name, 'twin'][0]:.3f}, "
            f"plain step {plain[name] * 1e3:.1f} ms)"
            for (name, label), (ratio, low, high) in ratios.items()
            if label == "monitored"
        ]
        load = "/".join(f"{value:.1f}" for value in os.getloadavg())
        what = "recording/monitored" if args.record else "monitored/plain"
        print(f"{recipe:18s} {what}: " + "; ".join(parts) + f"; load {load}", flush=True)


if __name__ == "__main__":
    main()
