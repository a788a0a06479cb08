"""``memory_report``: exact bytes of a training setup's weights, gradients and optimizer state.

Counted from the tensors themselves (``numel * element_size``), never estimated:

- **parameters**: the model's parameters (tied ones once).
- **gradients**: one gradient per trainable parameter, in its dtype: what backward
  allocates, counted whether or not it is allocated at the moment of the call. An
  optimizer that steps in backward (:func:`amped.optim.step_in_backward`) frees each
  gradient in its hook, so none is held: its gradients count 0, and the largest one,
  alive during its hook, is reported apart (``transient_grads``, in the peak).
- **master copies**: tensors the optimizer steps that are not model parameters
  (O2's float32 masters).
- **optimizer state**: every tensor in ``optimizer.state`` (moments, momentum,
  Kahan compensation, step counters), by key. Built at the first step: call after it.
- **FP8 state**: the amax histories and scales of layers under delayed scaling
  (buffers named ``fp8_*``; a row only when there are any).
- **master gradients**: the float32 gradients of the masters, which exist only from
  ``grads_to_masters`` to the end of the step (O2), while the low-precision gradients
  they replace are already freed; reported apart, with the step's peak.

**Sharded models** (FSDP2's ``fully_shard``): every figure is this rank's, from the
local shards of its parameters, gradients and state (DTensors count their local
tensor), and :attr:`MemoryReport.num_params` is the number of parameter elements this
rank holds, so bytes per parameter read as in one process. The shards of all ranks add
up to the unsharded parameters and gradients exactly; FSDP2's all-gathered weights,
alive while a group computes (one or two groups at a time, as it prefetches), are not
included.

Activations and autocast's per-step weight casts (O1 keeps a low-precision copy of
each float32 weight for the duration of the forward pass) are not included.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from amped.optim.in_backward import in_backward
from amped.optim.shards import local

__all__ = ["MemoryReport", "memory_report"]


def _nbytes(tensor: torch.Tensor) -> int:
    """The bytes this rank holds of ``tensor`` (a DTensor: its local shard)."""
    held = local(tensor)
    return held.numel() * held.element_size()


@dataclass(frozen=True)
class MemoryReport:
    """Bytes of one model and optimizer, by role. Per-parameter figures divide by
    :attr:`num_params`, the number of model parameter elements (under FSDP2: those this
    rank holds)."""

    num_params: int
    params: int
    grads: int
    masters: int
    optimizer_state: int
    master_grads: int = 0
    freed_grads: int = 0
    state_by_key: dict[str, int] = field(default_factory=dict)
    params_by_dtype: dict[str, int] = field(default_factory=dict)
    fp8_state: int = 0
    transient_grads: int = 0

    @property
    def total(self) -> int:
        """Bytes held between steps: parameters, gradients, masters and optimizer state."""
        return self.params + self.grads + self.masters + self.optimizer_state + self.fp8_state

    @property
    def peak(self) -> int:
        """Bytes during the step: :attr:`total` with the low-precision gradients of
        lowered weights replaced by their masters' float32 gradients, plus the largest
        gradient when the optimizer steps in backward."""
        return self.total + self.master_grads - self.freed_grads + self.transient_grads

    def per_param(self, nbytes: int) -> float:
        """``nbytes`` divided by the number of parameter elements."""
        return nbytes / self.num_params if self.num_params else 0.0

    @property
    def bytes_per_param(self) -> float:
        """:attr:`total` per parameter element (16.0 for float32 AdamW, plus step counters)."""
        return self.per_param(self.total)

    def as_dict(self) -> dict[str, object]:
        """Every figure, bytes and bytes per parameter, as plain data."""
        rows = self._rows()
        return {
            "num_params": self.num_params,
            **{name: nbytes for name, nbytes in rows},
            "state_by_key": dict(self.state_by_key),
            "params_by_dtype": dict(self.params_by_dtype),
            "bytes_per_param": {name: self.per_param(nbytes) for name, nbytes in rows},
        }

    def _rows(self) -> list[tuple[str, int]]:
        fp8 = [("fp8_state", self.fp8_state)] if self.fp8_state else []
        transient = [("transient_grads", self.transient_grads)] if self.transient_grads else []
        return [
            ("params", self.params),
            ("grads", self.grads),
            ("masters", self.masters),
            ("optimizer_state", self.optimizer_state),
            *fp8,
            ("total", self.total),
            ("master_grads", self.master_grads),
            *transient,
            ("peak", self.peak),
        ]

    def table(self) -> str:
        """A small plain-text table (bytes and bytes per parameter)."""
        labels = {
            "params": "parameters",
            "grads": "gradients",
            "masters": "master copies",
            "optimizer_state": "optimizer state",
            "fp8_state": "FP8 amax history, scales",
            "total": "total",
            "master_grads": "master gradients (in step)",
            "transient_grads": "largest gradient (in hook)",
            "peak": "peak",
        }
        dtypes = ", ".join(f"{d} {n:,}" for d, n in self.params_by_dtype.items())
        lines = [f"{self.num_params:,} parameters ({dtypes})"]
        lines.append(f"  {'':<28}{'bytes':>14}{'bytes/param':>13}")
        for name, nbytes in self._rows():
            lines.append(f"  {labels[name]:<28}{nbytes:>14,}{self.per_param(nbytes):>13.2f}")
            if name == "optimizer_state":
                for key, kbytes in self.state_by_key.items():
                    lines.append(f"    {key:<26}{kbytes:>14,}{self.per_param(kbytes):>13.2f}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def memory_report(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> MemoryReport:
    """Exact bytes of ``model``'s parameters and gradients and ``optimizer``'s masters and state.

    Pass the optimizer the loop steps (``setup.optimizer`` after :func:`amped.prepare`).
    Reads shapes and dtypes only: no sync, no allocation.

    Example:
        >>> import torch, amped
        >>> model = torch.nn.Linear(100, 10)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> model(torch.randn(2, 100)).sum().backward()
        >>> opt.step()
        >>> report = amped.memory_report(model, opt)
        >>> report.bytes_per_param
        12.0
    """
    params = list(model.parameters())
    model_ids = {id(p) for p in params}
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    masters = _unique(p for p in stepped if id(p) not in model_ids)
    # O2 frees each low-precision gradient once its float32 master gradient exists.
    lowered = [param for param, _ in getattr(optimizer, "pairs", ()) if param.requires_grad]
    by_dtype: dict[str, int] = {}
    for p in params:
        name = str(p.dtype).removeprefix("torch.")
        by_dtype[name] = by_dtype.get(name, 0) + local(p).numel()
    by_key: dict[str, int] = {}
    for entry in optimizer.state.values():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                by_key[key] = by_key.get(key, 0) + _nbytes(value)
    grads = [_nbytes(p) for p in params if p.requires_grad]
    hooked = in_backward(optimizer)
    return MemoryReport(
        num_params=sum(local(p).numel() for p in params),
        params=sum(_nbytes(p) for p in params),
        grads=0 if hooked else sum(grads),
        transient_grads=max(grads, default=0) if hooked else 0,
        masters=sum(_nbytes(m) for m in masters),
        optimizer_state=sum(by_key.values()),
        master_grads=sum(_nbytes(m) for m in masters if m.requires_grad),
        freed_grads=sum(_nbytes(p) for p in lowered),
        state_by_key=by_key,
        params_by_dtype=by_dtype,
        fp8_state=sum(
            _nbytes(b) for n, b in model.named_buffers() if n.rpartition(".")[2].startswith("fp8_")
        ),
    )


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        seen.setdefault(id(t), t)
    return list(seen.values())
