"""What a module-rule region costs per module call, and so per training step.

A policy with module rules (``Policy.with_module``; the bf16-master / fp16-master recipes
keep their norms in float32 through hooks on those modules instead) installs global
module hooks while its region is open (docs/engine.md, "Module rules are module hooks").
A global hook moves every ``nn.Module.__call__`` off torch's fast path, and the hooks run
Python per call. This measures, per call of a module the rule does not match (a
``nn.Identity`` on a 1-element tensor, so the call is nearly all overhead):

* "none": inside ``torch.autocast``, no global hooks (torch's fast path);
* "pre": inside ``torch.autocast``, one global forward pre-hook that does nothing: the
  floor of any global hook (torch's slow path, one Python call);
* "empty": a global forward pre-hook and forward hook (``always_call=True``, as amped's)
  that do nothing: torch's slow path with amped's two hooks, without their work;
* "amped": inside ``amped.autocast`` with a module rule matching no module of the models
  (``nn.LSTM`` in float32), amped's hooks idle on every call;
* "matched": a ``"skip"`` rule that matches the module (autocast off inside it, as
  ``custom_fwd`` would): what a module the rule selects costs (not multiplied below:
  how many match depends on the rule);

interleaved, the thread's CPU time, medians over repeats and the interquartile range of
the paired differences to "none". Then it counts module calls per training step of the
overhead script's models and multiplies: the step ratio excess a module-rule region is
expected to show (step time measured under ``torch.autocast``). That product resolves
what a whole-step ratio, at +-0.04 on a shared machine, cannot.

    python benchmarks/autocast_module_calls.py [--repeats 21] [--calls 20000]
        [--models encoder,gpt2,cnn]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import time
from collections.abc import Iterator

import torch
import torch.nn as nn
from autocast_overhead import MODELS, MODULE_RULE, orders
from torch.nn.modules import module as nn_module

import amped
from amped.comparison.environment import cpu_name

SIDES = ("none", "pre", "empty", "amped", "matched")
MATCHED = amped.Policy.preset("torch", "cpu").with_module(nn.Identity, "skip")


def _nothing(*_: object) -> None:
    return None


@contextlib.contextmanager
def empty_hooks(post: bool) -> Iterator[None]:
    handles = [nn_module.register_module_forward_pre_hook(_nothing)]
    if post:
        handles.append(nn_module.register_module_forward_hook(_nothing, always_call=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def region(side: str) -> contextlib.AbstractContextManager:
    if side in ("amped", "matched"):
        return amped.autocast("cpu", policy=MODULE_RULE if side == "amped" else MATCHED)
    if side in ("pre", "empty"):
        stack = contextlib.ExitStack()
        stack.enter_context(torch.autocast("cpu"))
        stack.enter_context(empty_hooks(post=side == "empty"))
        return stack
    return torch.autocast("cpu")


def quartiles(values: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def per_module_call(repeats: int, calls: int) -> dict[str, tuple[float, float, float]]:
    """side -> (median us per call, added us vs "none", IQR of the paired added us)."""
    module, x = nn.Identity(), torch.ones(1)
    samples: dict[str, list[float]] = {side: [] for side in SIDES}
    for i in range(repeats):
        for side in orders(i, SIDES):
            gc.collect()
            with region(side):
                module(x)
                start = time.thread_time()
                for _ in range(calls):
                    module(x)
                samples[side].append((time.thread_time() - start) / calls * 1e6)
    out = {}
    for side in SIDES:
        paired = [a - b for a, b in zip(samples[side], samples["none"], strict=True)]
        low, high = quartiles(paired)
        out[side] = (statistics.median(samples[side]), statistics.median(paired), high - low)
    return out


def module_calls_per_step(name: str) -> tuple[int, float]:
    """Module calls in one training step of ``name`` (forward: hooks run there only),
    and the step's median CPU time under torch.autocast (s)."""
    torch.manual_seed(0)
    model, run = MODELS[name]()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    count = 0

    def counting(*_: object) -> None:
        nonlocal count
        count += 1

    handle = nn_module.register_module_forward_pre_hook(counting)
    with torch.autocast("cpu"):
        run(model)
    handle.remove()
    times = []
    for i in range(7):
        gc.collect()
        start = time.thread_time()
        with torch.autocast("cpu"):
            loss = run(model)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(time.thread_time() - start)
    return count, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    figures = per_module_call(args.repeats, args.calls)
    load = os.getloadavg()
    print(f"torch {torch.__version__}, 1 thread, thread CPU time, {args.repeats} repeats")
    print(f"CPU {cpu_name()}, {os.cpu_count()} cores; load average {load[0]:.2f} {load[1]:.2f}")
    print("per module call (nn.Identity): us, added vs none [IQR of paired]")
    for side, (median, extra, iqr) in figures.items():
        print(f"  {side:6s} {median:7.3f} us   {extra:+7.3f} us  [{iqr:.3f}]")
    print("expected step ratio, unmatched modules = 1 + added us x module calls per step / step")
    for name in args.models.split(","):
        count, step = module_calls_per_step(name)
        excess = {side: figures[side][1] * count / (step * 1e6) for side in SIDES[1:-1]}
        print(
            f"  {name:8s} {count:5d} calls/step, step {step * 1e3:7.2f} ms   "
            + "   ".join(f"{side} {1 + e:.4f}" for side, e in excess.items())
        )


if __name__ == "__main__":
    main()
