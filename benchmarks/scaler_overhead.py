"""Overhead of amped.GradScaler against torch.amp.GradScaler, on the CPU (or ``--device``).

Times ``unscale_(optimizer) + step(optimizer) + update()`` for 10, 100 and 1000
parameter tensors (256 float32 elements each). The optimizer's own step is a no-op on
both sides, so only the scalers' work is timed. The two scalers run side by side in one
process, interleaved one iteration at a time (order alternating), the gradients reset
untimed between iterations; a repeat sums ``--iterations`` iterations per side, and the
printed ratio is the median over repeats. Also counts host reads of tensor values
(``item``, ``tolist``, ``bool(tensor)``, ...) per iteration: each is a host-device sync
on an accelerator.

On CUDA (``--device cuda``) each timed iteration ends with ``torch.cuda.synchronize()``,
so the kernels the scalers launch are timed as well as the host's work. ``--json PATH``
also writes the figures to a file (for ``benchmarks/support/gpu_check.py``).

Usage: python benchmarks/scaler_overhead.py [--repeats 31] [--iterations 20]
                                            [--device cpu] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from support.device_sync import synchronize

import amped
from amped._internal.jsonio import to_json

SIZES = (10, 100, 1000)
ELEMENTS = 256
SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
DEVICE = "cpu"


def set_device(device: str) -> None:
    """Set the device the scalers, parameters and gradients live on."""
    global DEVICE
    DEVICE = device


class NoStep:
    """An optimizer in all a GradScaler uses (``param_groups``, ``step``) whose step does
    nothing, so neither side pays for an update, nor for torch.optim's step hooks."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.param_groups = [{"params": params}]

    def step(self) -> None:
        return None


class Side:
    """A scaler with its own parameters and stored (scaled) gradients."""

    def __init__(self, make: Callable[[], Any], count: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.params = [
            torch.nn.Parameter(torch.zeros(ELEMENTS, device=DEVICE)) for _ in range(count)
        ]
        self.grads = [
            (torch.randn(ELEMENTS, generator=generator) * 1e4).to(DEVICE) for _ in range(count)
        ]
        for param, grad in zip(self.params, self.grads, strict=True):
            param.grad = grad.clone()
        self.optimizer = NoStep(self.params)
        self.scaler = make()
        # Creates the scale, as the first loss would.
        self.scaler.scale(torch.ones((), device=DEVICE))

    def reset(self) -> None:
        torch._foreach_copy_([p.grad for p in self.params], self.grads)

    def iteration(self) -> None:
        self.scaler.unscale_(self.optimizer)
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def timed_iteration(self) -> int:
        self.reset()
        synchronize(DEVICE)
        start = time.perf_counter_ns()
        self.iteration()
        synchronize(DEVICE)
        return time.perf_counter_ns() - start


@contextlib.contextmanager
def counting_host_reads() -> Iterator[list[str]]:
    calls: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}

    def counted(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return original(self, *args, **kwargs)

        return wrapper

    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(name, original))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def syncs_per_iteration(side: Side) -> int:
    side.reset()
    with counting_host_reads() as calls:
        side.iteration()
    return len(calls)


def compare(label: str, make_amped: Callable[[], Any], count: int, args: Any) -> dict[str, float]:
    ours = Side(make_amped, count)
    theirs = Side(lambda: torch.amp.GradScaler(DEVICE), count)
    for _ in range(args.iterations):  # warm up
        ours.timed_iteration()
        theirs.timed_iteration()
    ratios, ours_us, theirs_us = [], [], []
    for repeat in range(args.repeats):
        totals = {id(ours): 0, id(theirs): 0}
        for iteration in range(args.iterations):
            # Interleaved one iteration at a time, the order alternating, so that drift
            # on a shared machine lands on both sides alike.
            pair = (ours, theirs) if (repeat + iteration) % 2 == 0 else (theirs, ours)
            for side in pair:
                totals[id(side)] += side.timed_iteration()
        ours_us.append(totals[id(ours)] / args.iterations / 1e3)
        theirs_us.append(totals[id(theirs)] / args.iterations / 1e3)
        ratios.append(totals[id(ours)] / totals[id(theirs)])
    print(
        f"{label:<18} {count:>5} tensors: amped {statistics.median(ours_us):7.1f} us, "
        f"torch {statistics.median(theirs_us):7.1f} us, "
        f"syncs/step amped {syncs_per_iteration(ours)} torch {syncs_per_iteration(theirs)}, "
        f"ratio amped/torch = {statistics.median(ratios):.3f}"
    )
    return {
        "amped_us": statistics.median(ours_us),
        "torch_us": statistics.median(theirs_us),
        "amped_syncs": syncs_per_iteration(ours),
        "torch_syncs": syncs_per_iteration(theirs),
        "ratio": statistics.median(ratios),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    set_device(args.device)
    torch.set_num_threads(1)
    where = "CPU" if DEVICE == "cpu" else f"CUDA ({torch.cuda.get_device_name()})"
    print(f"torch {torch.__version__}, {where}, 1 thread, {args.repeats} repeats")
    configs: dict[str, Callable[[], Any]] = {
        "default": lambda: amped.GradScaler(DEVICE),
        "hysteresis+bounds": lambda: amped.GradScaler(
            DEVICE, hysteresis=2, min_scale=1.0, max_scale=2.0**24
        ),
        "record_history": lambda: amped.GradScaler(DEVICE, record_history=True),
    }
    figures: dict[str, dict[str, dict[str, float]]] = {}
    for label, make in configs.items():
        for count in SIZES:
            figures.setdefault(label, {})[str(count)] = compare(label, make, count, args)
    if args.json:
        Path(args.json).write_text(
            to_json({"device": DEVICE, "repeats": args.repeats, "scalers": figures})
        )


if __name__ == "__main__":
    main()
