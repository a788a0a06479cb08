"""Memory a recipe costs: its training state's bytes, and its peak memory.

Training state comes from :func:`amped.memory_report` (exact bytes of parameters,
gradients, optimizer state and master copies). Peak memory is the CUDA allocator's
peak on a GPU, and on a CPU the growth of the process's resident set over the recipe's
start, sampled after each forward, backward and optimizer step (approximate: an
allocation freed between samples is missed, and the C allocator may keep freed pages).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import resource
import sys
from dataclasses import dataclass

import torch

from amped.recipes import memory_report

__all__ = ["PeakMemory", "StateBytes", "grad_bytes", "release_freed_memory", "state_bytes"]

SOURCE = "amped.memory_report"


@dataclass(frozen=True)
class StateBytes:
    """Bytes of training state, by kind, and per model parameter."""

    params: int
    grads: int
    optimizer_state: int
    masters: int
    param_count: int
    source: str = SOURCE

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer_state + self.masters

    @property
    def per_param(self) -> float:
        return self.total / max(self.param_count, 1)


def grad_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's gradients now (call right after ``backward``)."""
    storages = (p.grad.untyped_storage() for p in model.parameters() if p.grad is not None)
    return sum({s.data_ptr(): s.nbytes() for s in storages}.values())  # shared storage once


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer, grads: int) -> StateBytes:
    """The training state of ``model`` and ``optimizer`` (call after an optimizer step).

    ``grads`` is :func:`grad_bytes` right after backward: a recipe that frees gradients
    during the step still counts them.
    """
    report = memory_report(model, optimizer)
    return StateBytes(
        params=report.params,
        grads=max(report.grads, grads),
        optimizer_state=report.optimizer_state,
        masters=report.masters,
        param_count=report.num_params,
    )


def _rss_bytes() -> int | None:
    """The resident set size now (Linux), or None where /proc is not available."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def release_freed_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (Linux)."""
    gc.collect()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)


class PeakMemory:
    """Peak memory of one recipe's run: allocator peak on CUDA, RSS growth on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.kind = "cuda_allocator_peak" if device.type == "cuda" else "rss_growth"
        self._start = 0
        self._peak = 0

    def start(self) -> None:
        release_freed_memory()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        rss = _rss_bytes()
        if rss is None:  # no /proc: the process's lifetime peak is all there is
            self.kind = "process_peak_rss"
            rss = 0
        self._start = self._peak = rss

    def sample(self) -> None:
        if self.kind == "rss_growth":
            self._peak = max(self._peak, _rss_bytes() or 0)

    def peak_bytes(self) -> int:
        if self.kind == "cuda_allocator_peak":
            return int(torch.cuda.max_memory_allocated(self.device))
        if self.kind == "process_peak_rss":
            scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes vs KiB
            return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale
        return self._peak - self._start
