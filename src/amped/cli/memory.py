"""Memory a recipe costs: exact training-state bytes, and peak process or allocator memory.

Training state is counted exactly, in bytes of unique tensor storage:

- ``params``: the model's parameters, in the dtype the recipe keeps them in;
- ``grads``: the model's gradients right after ``backward`` (their peak; some recipes
  free them during the step);
- ``optimizer_state``: every tensor in the optimizer's state (Adam moments, Kahan
  compensation buffers, step counters);
- ``masters``: parameters the optimizer steps that are not the model's (float32 master
  copies under the O2 recipes).

If ``amped.memory_report`` exists it is preferred for the total, and the source is
recorded. Peak memory is the CUDA caching allocator's peak on a GPU (exact), and on a CPU
the growth of the process's resident set size over the recipe's start, sampled after
each forward, backward and optimizer step (approximate: an allocation freed between
samples is missed, and the C allocator may keep freed pages).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import resource
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

import amped

__all__ = ["PeakMemory", "StateBytes", "grad_bytes", "state_bytes"]


@dataclass(frozen=True)
class StateBytes:
    """Bytes of training state, by kind, and per model parameter."""

    params: int
    grads: int
    optimizer_state: int
    masters: int
    param_count: int
    source: str = "amped.cli"

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer_state + self.masters

    @property
    def per_param(self) -> float:
        return self.total / max(self.param_count, 1)


def _unique_bytes(tensors: Iterable[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def grad_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's gradients now (call right after ``backward``)."""
    return _unique_bytes((p.grad for p in model.parameters() if p.grad is not None), set())


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer, grads: int) -> StateBytes:
    """The training state of ``model`` and ``optimizer`` (call after an optimizer step)."""
    seen: set[int] = set()
    params = list(model.parameters())
    param_total = _unique_bytes(params, seen)
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    masters = _unique_bytes(stepped, seen)
    tensors = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    measured = StateBytes(
        params=param_total,
        grads=grads,
        optimizer_state=_unique_bytes(tensors, seen),
        masters=masters,
        param_count=sum(p.numel() for p in params),
    )
    return _from_memory_report(model, optimizer, measured) or measured


def _from_memory_report(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, measured: StateBytes
) -> StateBytes | None:
    """The recipes layer's own figures, when it offers ``amped.memory_report``."""
    report = getattr(amped, "memory_report", None)
    if report is None:
        return None
    try:
        figures = report(model, optimizer)
    except Exception:
        return None

    def field(name: str) -> Any:
        value = figures.get(name) if isinstance(figures, dict) else getattr(figures, name, None)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    kinds = [field(n) for n in ("params", "grads", "optimizer_state", "masters")]
    if any(k is None for k in kinds):
        return None
    params, grads, optimizer_state, masters = kinds
    # The report sees the state after the step; gradients freed by then count as measured.
    return StateBytes(
        params, max(grads, measured.grads), optimizer_state, masters,
        measured.param_count, "amped.memory_report",
    )  # fmt: skip


def _rss_bytes() -> int | None:
    """The resident set size now (Linux), or None where /proc is not available."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _release_freed_memory() -> None:
    gc.collect()
    if sys.platform.startswith("linux"):
        # Hand freed heap pages back, so the next recipe's growth is its own.
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
        _release_freed_memory()
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
