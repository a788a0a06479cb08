"""Which gradients a loss scale keeps, loses to underflow, or overflows.

With loss scale ``S``, backward computes ``S * g`` in the low dtype. A non-zero ``g``
is lost when ``|S * g|`` falls below the dtype's smallest subnormal (it rounds to
zero), and the step overflows when ``|S * g|`` exceeds the dtype's largest finite
value. Both are judged on the float32 reference gradients, in float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from amped.doctor.stats import smallest_subnormal

__all__ = ["GradientCheck", "check_gradient", "recommended_scale"]


@dataclass(frozen=True)
class GradientCheck:
    """One parameter's gradient at one loss scale, in one low dtype.

    Attributes:
        name: the parameter's qualified name.
        underflow: fraction of its non-zero gradient values that ``scale`` loses.
        min_scale: the smallest power-of-two scale that keeps every non-zero value
            (None when all values are zero).
        overflows: whether ``scale`` pushes the largest value past the dtype's max.
        amax: largest |gradient| (unscaled).
        amin: smallest non-zero |gradient| (unscaled).
    """

    name: str
    scale: float
    underflow: float
    min_scale: float | None
    overflows: bool
    amax: float
    amin: float


def check_gradient(
    name: str, grad: torch.Tensor, scale: float, dtype: torch.dtype
) -> GradientCheck:
    g = grad.detach().to(torch.float64).abs()
    g = g[torch.isfinite(g)]
    nonzero = g[g > 0]
    if nonzero.numel() == 0:
        return GradientCheck(name, scale, 0.0, None, False, 0.0, 0.0)
    # Values at or below half the smallest subnormal round to zero (to nearest, ties to
    # even: the tie goes to zero).
    half = smallest_subnormal(dtype) / 2
    lost = int((nonzero * scale <= half).sum())
    amin, amax = float(nonzero.min()), float(nonzero.max())
    min_scale = 2.0 ** math.ceil(math.log2(half / amin))
    if amin * min_scale <= half:  # amin * 2**k landed exactly on the tie
        min_scale *= 2
    return GradientCheck(
        name=name,
        scale=scale,
        underflow=lost / nonzero.numel(),
        min_scale=min_scale,
        overflows=amax * scale > torch.finfo(dtype).max,
        amax=amax,
        amin=amin,
    )


def recommended_scale(checks: list[GradientCheck], dtype: torch.dtype) -> float | None:
    """The largest power-of-two scale under which no gradient overflows, with 2x headroom.

    GradScaler's dynamic scaling moves by powers of two; leaving one factor of two of
    headroom means the first growth step does not immediately overflow.
    """
    amax = max((c.amax for c in checks), default=0.0)
    if amax == 0.0:
        return None
    return 2.0 ** math.floor(math.log2(torch.finfo(dtype).max / amax / 2))
