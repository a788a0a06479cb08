"""Numerics of one tensor against a reference and against a dtype's limits.

All statistics are computed in float64 on detached copies, so the measurement does
not itself overflow or round (a float16 tensor's sum of squares easily exceeds 65504).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["ErrorStats", "measure_error", "smallest_subnormal", "summarize"]


def smallest_subnormal(dtype: torch.dtype) -> float:
    """The smallest positive value ``dtype`` holds (``torch.finfo`` stops at normals)."""
    info = torch.finfo(dtype)
    return info.tiny * info.eps  # smallest normal * 2**-(mantissa bits)


@dataclass(frozen=True)
class TensorSummary:
    amax: float  # largest finite |value| (0 if none)
    amin: float  # smallest non-zero finite |value| (0 if none)
    n_inf: int
    n_nan: int
    numel: int


def summarize(t: torch.Tensor) -> TensorSummary:
    """Range and non-finite counts of ``t``."""
    x = t.detach().to(torch.float64)
    finite = torch.isfinite(x)
    a = x.abs()[finite]
    nonzero = a[a > 0]
    return TensorSummary(
        amax=float(a.max()) if a.numel() else 0.0,
        amin=float(nonzero.min()) if nonzero.numel() else 0.0,
        n_inf=int(torch.isinf(x).sum()),
        n_nan=int(torch.isnan(x).sum()),
        numel=x.numel(),
    )


@dataclass(frozen=True)
class ErrorStats:
    """A low-precision tensor against its float32 reference."""

    underflow: float  # fraction of reference non-zeros that are zero or subnormal here
    rel_error: float  # ||t - ref|| / ||ref|| over positions finite in both
    sqnr_db: float  # 10 log10(||ref||^2 / ||t - ref||^2); inf when identical


def measure_error(t: torch.Tensor, reference: torch.Tensor) -> ErrorStats | None:
    """``t`` (low precision) against ``reference`` (float32 run); None if shapes differ."""
    if t.shape != reference.shape:
        return None
    x = t.detach().to(torch.float64)
    r = reference.detach().to(torch.float64)
    tiny = torch.finfo(t.dtype).tiny if t.is_floating_point() else 0.0
    ref_nonzero = r != 0
    lost = ref_nonzero & (x.abs() < tiny)
    n_ref = int(ref_nonzero.sum())
    underflow = int(lost.sum()) / n_ref if n_ref else 0.0
    both = torch.isfinite(x) & torch.isfinite(r)
    if bool((torch.isfinite(r) & ~torch.isfinite(x)).any()):  # broke where float32 did not
        return ErrorStats(underflow=underflow, rel_error=math.inf, sqnr_db=-math.inf)
    signal = float((r[both] ** 2).sum())
    noise = float(((x[both] - r[both]) ** 2).sum())
    rel_error = math.sqrt(noise / signal) if signal > 0 else (0.0 if noise == 0 else math.inf)
    if noise == 0:
        sqnr = math.inf
    elif signal == 0:
        sqnr = -math.inf
    else:
        sqnr = 10 * math.log10(signal / noise)
    return ErrorStats(underflow=underflow, rel_error=rel_error, sqnr_db=sqnr)
