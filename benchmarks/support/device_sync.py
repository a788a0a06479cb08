"""What the benchmarks' timers need on an accelerator: its queued work finished."""

from __future__ import annotations

import torch


def synchronize(device: str) -> None:
    """Wait for ``device``'s queued kernels, so that a timer sees them (no-op on the CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()
