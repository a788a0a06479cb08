"""The compensated optimizers' step against torch's foreach optimizers, CPU.

Sides, each on its own copy of the same parameters with fixed gradients, stepped side
by side in one process, interleaved one step at a time (the order rotating every
repeat); the printed ratio is the median over repeats of ``time(side) /
time(baseline)``:

- ``CompensatedAdamW`` on bfloat16 parameters, ``compensation="kahan"`` (bf16-pure)
  and ``"stochastic"`` (bf16-pure-sr), each with its default fused step (one compiled
  kernel per chunk; compiled during the warm-up steps) and with ``fused=False`` (the
  eager step, marked "eager"), against ``torch.optim.AdamW(foreach=True)`` on
  **float32** parameters: that is the optimizer the recipe replaces (torch O1 keeps
  float32 weights and state), so the ratio is what bf16-pure costs or saves in the
  step. torch's AdamW on bfloat16 parameters is timed too, for reference only: it
  rounds every update and state to nearest, so small updates are lost (the problem the
  compensated optimizers solve), and it is not a recipe.
- ``CompensatedAdamW8bit`` (bf16-pure-8bit: 8-bit moments, stochastic rounding), with
  its fused step (one compiled kernel per tensor with quantized moments) and eager
  (``fused=False``), against the same float32 baseline; its ratio to the compensated
  stochastic fused step is the quotient of the two printed ratios.
- ``CompensatedSGD`` (momentum 0.9, both compensations, fused and eager) against
  ``torch.optim.SGD(momentum=0.9, foreach=True)`` on float32 parameters.

- ``MasterWeightOptimizer`` (bf16-master's optimizer: bfloat16 parameters and
  gradients, float32 masters) over torch's AdamW or SGD, with its fused step (one
  compiled kernel per chunk: gradient in, master, state and bfloat16 weight out) and
  unfused (``fused=False``: gradients cast to float32, torch's step on the masters,
  masters copied back), against the same float32 baseline: what bf16-master's step
  costs against torch O1's. Both free the bfloat16 gradients they read, so each timed
  step first gives the parameters their fixed gradients back (a Python attribute set
  per tensor, included in the time).

Parameter sets: the shapes of the 4-layer encoder of ``benchmarks/recipes.py``
(48 tensors, 3.2 M elements), of GPT-2 small (148 tensors, 124 M elements; about
5 GB of memory for all sides together) and 2000 small tensors (64 to 1024 elements,
1.1 M in all: biases and norms).

Clocks: ``--clock wall`` (default) times each step by the wall clock; ``--clock thread``
by the calling thread's CPU time (``time.thread_time``; with ``--threads 1`` all the
step's work runs on it), which a machine shared with other work does not inflate when it
preempts the benchmark. Under load, wall-clock ratios are biased against the slower
side: a longer step is more likely to be preempted.

Usage: python benchmarks/optimizer_step.py [--sets encoder gpt2-small small]
                                           [--repeats 15] [--threads N]
                                           [--clock wall|thread]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from amped.comparison.environment import cpu_name
from amped.optim import CompensatedAdamW, CompensatedSGD, MasterWeightOptimizer
from amped.optim.adamw8bit import CompensatedAdamW8bit

Shapes = list[tuple[int, ...]]


def encoder_shapes() -> Shapes:
    layer = torch.nn.TransformerEncoderLayer(256, 4, dim_feedforward=1024, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
    return [tuple(p.shape) for p in model.parameters()]


def gpt2_small_shapes() -> Shapes:
    """GPT-2 small (transformers' GPT2LMHeadModel, the head tied to the embedding)."""
    d, vocab, positions, layers = 768, 50257, 1024, 12
    block = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,)]  # ln_1, attention
    block += [(d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]  # ln_2, MLP
    return [(vocab, d), (positions, d), *block * layers, (d,), (d,)]


def small_shapes() -> Shapes:
    g = torch.Generator().manual_seed(0)
    return [(int(n),) for n in torch.randint(64, 1025, (2000,), generator=g)]


SETS: dict[str, Callable[[], Shapes]] = {
    "encoder": encoder_shapes,
    "gpt2-small": gpt2_small_shapes,
    "small": small_shapes,
}


def make_params(shapes: Shapes, dtype: torch.dtype) -> list[torch.Tensor]:
    """Parameters and fixed gradients, the same values for every side (then rounded)."""
    g = torch.Generator().manual_seed(0)
    params = []
    for shape in shapes:
        param = torch.randn(shape, generator=g).to(dtype).requires_grad_(True)
        param.grad = (torch.randn(shape, generator=g) * 1e-3).to(dtype)
        params.append(param)
    return params


def sides(shapes: Shapes, kind: str) -> dict[str, Callable[[], object]]:
    """Optimizer steps to time; the first is the baseline."""
    fp32, bf16 = torch.float32, torch.bfloat16
    if kind == "adamw":
        sides = {"torch AdamW fp32": torch.optim.AdamW(make_params(shapes, fp32), foreach=True)}
        for compensation in ("kahan", "stochastic"):
            for fused in (None, False):
                name = f"Compensated {compensation} bf16" + (" eager" if fused is False else "")
                params = make_params(shapes, bf16)
                sides[name] = CompensatedAdamW(params, compensation=compensation, fused=fused)
        for fused in (None, False):
            name = "8-bit stochastic bf16" + (" eager" if fused is False else "")
            sides[name] = CompensatedAdamW8bit(make_params(shapes, bf16), fused=fused)
        sides["torch AdamW bf16 (lossy)"] = torch.optim.AdamW(
            make_params(shapes, bf16), foreach=True
        )
        steps = {name: optimizer.step for name, optimizer in sides.items()}
        return {**steps, **master_steps(shapes, torch.optim.AdamW, {})}
    sides = {
        "torch SGD fp32": torch.optim.SGD(
            make_params(shapes, fp32), lr=1e-3, momentum=0.9, foreach=True
        )
    }
    for compensation in ("kahan", "stochastic"):
        for fused in (None, False):
            name = f"Compensated {compensation} bf16" + (" eager" if fused is False else "")
            params = make_params(shapes, bf16)
            sides[name] = CompensatedSGD(
                params, lr=1e-3, momentum=0.9, compensation=compensation, fused=fused
            )
    steps = {name: optimizer.step for name, optimizer in sides.items()}
    return {**steps, **master_steps(shapes, torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9})}


def master_steps(
    shapes: Shapes, kind: type[torch.optim.Optimizer], options: dict
) -> dict[str, Callable[[], object]]:
    """MasterWeightOptimizer over ``kind``, fused and unfused; each step first puts the
    fixed bfloat16 gradients back (both steps free them)."""
    steps = {}
    for fused in (None, False):
        params = make_params(shapes, torch.bfloat16)
        grads = [p.grad for p in params]
        optimizer = MasterWeightOptimizer(kind(params, **options), fused=fused)

        def step(params=params, grads=grads, optimizer=optimizer) -> None:
            for param, grad in zip(params, grads, strict=True):
                param.grad = grad
            optimizer.step()

        steps["Master bf16/fp32" + (" unfused" if fused is False else " fused")] = step
    return steps


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "thread": time.thread_time}


def time_ratios(
    steps: dict[str, Callable[[], object]],
    repeats: int,
    warmup: int,
    clock: Callable[[], float] = time.perf_counter,
):
    """Median baseline step time and each side's median ratio to it."""
    names = list(steps)
    for _ in range(warmup):
        for name in names:
            steps[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = clock()
            steps[name]()
            times[name].append(clock() - start)
    base = times[names[0]]
    ratios = {
        name: statistics.median(t / b for t, b in zip(times[name], base, strict=True))
        for name in names[1:]
    }
    return statistics.median(base), ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", nargs="+", choices=list(SETS), default=list(SETS))
    parser.add_argument("--kinds", nargs="+", choices=["adamw", "sgd"], default=["adamw", "sgd"])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{cpu_name()}, torch {torch.__version__}, {args.threads} threads, {args.clock} clock")
    for name in args.sets:
        shapes = SETS[name]()
        numel = sum(torch.Size(shape).numel() for shape in shapes)
        print(f"\n{name}: {len(shapes)} tensors, {numel / 1e6:.1f} M elements")
        for kind in args.kinds:
            steps = sides(shapes, kind)
            base, ratios = time_ratios(steps, args.repeats, args.warmup, CLOCKS[args.clock])
            baseline = next(iter(steps))
            print(f"  {baseline} step (median)  {base * 1e3:8.2f} ms")
            for side, ratio in ratios.items():
                print(f"  ratio {side}/{baseline} = {ratio:.3f}")
            del steps


if __name__ == "__main__":
    main()
