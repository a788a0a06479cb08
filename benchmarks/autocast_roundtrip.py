"""Where the ``KERNELS`` path's cost on a large op comes from: the round trip or the work.

One ``F.linear`` at the encoder's shape (8x32x256 by 768x256, bias; weight and bias are
leaves that require grad), bf16 autocast on the CPU, under six sides:

* "torch": ``torch.autocast``, no Python kernel registered;
* "pass": a Python kernel at ``AutocastCPU`` for ``aten::linear`` that only calls
  torch's own autocast kernel: the dispatcher's round trip into Python, nothing else;
* "pass+loop": the same, plus 50 dict look-ups in Python per call (1.6 us alone);
* "pass+empty": the same, plus one ``torch.empty`` of 64 KiB per call (0.9 us alone);
* "pycast": a minimal casting kernel (key excluded, input cast in Python, weight and bias
  from a dict, the op called again from Python);
* "amped": amped's own kernel (the private ``forced_path(Path.KERNELS)``).

Sides interleaved in one process, thread CPU time, medians; the minor page faults per
call are printed too. Tests never assert on these figures.

    python benchmarks/autocast_roundtrip.py [--backward] [--samples 15] [--calls 50]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import resource
import statistics
import time
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

import amped
from amped._internal import torch_compat
from amped.autocast_mode import Path, dispatch
from amped.autocast_mode.engine import forced_path
from amped.comparison.environment import cpu_name

OP = torch.ops.aten.linear.default
TORCH_KERNEL = torch.library.get_kernel(OP, "AutocastCPU")
ANY_KEYSET = torch_compat.dispatch_keyset_full()
KEY = torch_compat.DispatchKey.AutocastCPU
JUNK = {i: i for i in range(100)}
CACHE: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def passthrough(*args, **kwargs):
    return TORCH_KERNEL.call_boxed(ANY_KEYSET, *args, **kwargs)


def passthrough_loop(*args, **kwargs):
    total = 0
    for i in range(50):
        total += JUNK[i]
    return TORCH_KERNEL.call_boxed(ANY_KEYSET, *args, **kwargs)


def passthrough_empty(*args, **kwargs):
    torch.empty(16384)
    return TORCH_KERNEL.call_boxed(ANY_KEYSET, *args, **kwargs)


def pycast(x, w, b):
    torch_compat.set_dispatch_key_excluded(KEY, True)
    try:
        cached = CACHE.get(id(w))
        if cached is None:
            cached = CACHE[id(w)] = (w.to(torch.bfloat16), b.to(torch.bfloat16))
        return OP._op(x.to(torch.bfloat16), *cached)
    finally:
        torch_compat.set_dispatch_key_excluded(KEY, False)


@contextlib.contextmanager
def kernel_at_autocast(kernel: Callable | None) -> Iterator[None]:
    lib = None
    if kernel is not None:
        lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # "overriding a previously registered kernel"
            warnings.simplefilter("ignore", UserWarning)
            lib.impl(OP, kernel, "AutocastCPU")
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            CACHE.clear()  # the region's weight cache, as torch's
            yield
    finally:
        if lib is not None:
            torch_compat.destroy_library(lib)


@contextlib.contextmanager
def amped_kernels() -> Iterator[None]:
    try:
        with forced_path(Path.KERNELS), amped.autocast("cpu"):
            yield
    finally:  # amped's kernels stay registered, idle: the other sides must not meet them
        dispatch.release_kernels()


SIDES = {
    "torch": lambda: kernel_at_autocast(None),
    "pass": lambda: kernel_at_autocast(passthrough),
    "pass+loop": lambda: kernel_at_autocast(passthrough_loop),
    "pass+empty": lambda: kernel_at_autocast(passthrough_empty),
    "pycast": lambda: kernel_at_autocast(pycast),
    "amped": amped_kernels,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backward", action="store_true", help="time forward + backward")
    parser.add_argument("--samples", type=int, default=15)
    parser.add_argument("--calls", type=int, default=50, help="calls per sample")
    args = parser.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(8, 32, 256)
    w = torch.randn(768, 256, requires_grad=True)
    b = torch.randn(768, requires_grad=True)

    def sample(side: str) -> tuple[float, float]:
        with SIDES[side]():
            F.linear(x, w, b)  # untimed: the weight's cast, amped's registration
            faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            start = time.thread_time_ns()
            for _ in range(args.calls):
                out = F.linear(x, w, b)
                if args.backward:
                    out.float().sum().backward()
            spent = (time.thread_time_ns() - start) / args.calls / 1e3
            faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults
        return spent, faults / args.calls

    times: dict[str, list[float]] = {side: [] for side in SIDES}
    faults: dict[str, list[float]] = {side: [] for side in SIDES}
    for side in SIDES:
        sample(side)  # warm up
    for i in range(args.samples):
        for side in list(SIDES) if i % 2 == 0 else list(reversed(SIDES)):
            gc.collect()
            spent, fault = sample(side)
            times[side].append(spent)
            faults[side].append(fault)
    load = os.getloadavg()
    print(f"CPU {cpu_name()}, {os.cpu_count()} cores; load average {load[0]:.2f} {load[1]:.2f}")
    print(f"{'backward' if args.backward else 'forward'}: {args.samples} samples x {args.calls}")
    base = statistics.median(times["torch"])
    for side in SIDES:
        median = statistics.median(times[side])
        print(
            f"{side:10s} {median:9.1f} us/call  ratio {median / base:.3f}  "
            f"min {min(times[side]):9.1f}  minor faults/call {statistics.median(faults[side]):.1f}"
        )


if __name__ == "__main__":
    main()
