"""Per-GEMM health: what an FP8 (or block-format) layer reports after each of its GEMMs.

A low-precision linear layer runs three GEMMs, one per *role*::

    forward      output      = input       @ weight.T
    grad_input   grad_input  = grad_output @ weight
    grad_weight  grad_weight = grad_output.T @ input

After each one the layer calls :func:`record_gemm` with the GEMM's operands (the
high-precision tensor and its quantized form, where it has them) and its output. When
no observer is attached (``layer.fp8_observer`` is None, the default) that is one
attribute read. An observer (:class:`amped.recipes.monitoring.Monitor`) gets, on the device and
without a sync:

- every step, per tensor, a *probe* that tells whether it holds an inf or NaN, left on
  the device: an operand's is the smallest of its scales, which the cast computed
  anyway (a dynamic scale is 0 for an inf amax and NaN for a NaN one; a delayed one is
  NaN, see :func:`amped.fp8.delayed.propagate_nonfinite`), so it is bad unless > 0; an
  output's is its min and max (one ``aminmax`` pass), bad unless both are finite;
- on the steps it samples (``observer.sampling``), the counts in :data:`STATS`.

Any layer can report the same way: call ``record_gemm(self, role, output_name, output,
{operand_name: (high, quantized)})`` after each GEMM, with ``quantized`` an
:class:`~amped.fp8.cast.Fp8Tensor` (its ``scale`` multiplies, ``data`` is the
low-precision payload), a :class:`~amped.fp8.block_cast.BlockTensor` or None, and
``high`` the tensor before the cast or None.

A block tensor's scales do not show an inf reliably (an MX block holding an inf takes
the largest scale its mode allows, a finite value), so a block operand is probed by
its high-precision tensor (one ``aminmax`` pass), which :class:`~amped.fp8.block_linear.BlockLinear`
passes for every operand. Its sampled counters read the block scales: an element
saturates when its magnitude exceeds the format's largest element times its block's
scale (times NVFP4's tensor scale); a *scale clamp* is a block scale at the format's
floor (E8M0 ``2**-127``, NVFP4's ``2**-6``) or at E8M0's largest finite value.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from amped.fp8.block_cast import BlockTensor
from amped.fp8.cast import EPS, Fp8Tensor

__all__ = ["ROLES", "STATS", "GemmObserver", "Operand", "record_gemm"]

ROLES = ("forward", "grad_input", "grad_weight")
"""The three GEMMs of a linear layer, in the order a training step runs them."""

STATS = (
    "nonfinite",  # elements that are inf or NaN, in the operands and the output
    "underflow",  # non-zero operand elements the cast made zero
    "nonzero",  # non-zero operand elements (underflow's denominator)
    "saturated",  # operand elements the cast clamped to the format's largest value
    "elements",  # operand elements cast (saturated's denominator)
    "scale_clamps",  # scales at a clamp: amax below EPS, or a delayed scale at a bound
    "amax",  # the largest finite magnitude among the operands
)
"""The sampled counters of one GEMM, in this order (float32, summed; ``amax``: max)."""

Operand = tuple[torch.Tensor | None, Fp8Tensor | BlockTensor | None]


class GemmObserver(Protocol):
    """What :func:`record_gemm` reports to (``layer.fp8_observer``)."""

    sampling: bool

    def observe(
        self,
        layer: torch.nn.Module,
        role: str,
        scale_probes: list[tuple[str, torch.Tensor]],
        end_probes: list[tuple[str, tuple[torch.Tensor, torch.Tensor]]],
        stats: torch.Tensor | None,
    ) -> None:
        """``scale_probes``: (tensor, smallest scale), bad unless > 0; ``end_probes``:
        (tensor, (min, max)), bad unless both finite; ``stats``: :data:`STATS` or None."""


def record_gemm(
    layer: torch.nn.Module,
    role: str,
    output_name: str,
    output: torch.Tensor,
    operands: Mapping[str, Operand],
) -> None:
    """Report one GEMM of ``layer`` to its observer, if it has one (see the module)."""
    observer: Any = getattr(layer, "fp8_observer", None)
    if observer is None:
        return
    # One op per tensor (the flags are made from these in one batch, at the step's end).
    scale_probes, end_probes = [], []
    # A GEMM runs inside an autograd Function, where grad mode is off already.
    with torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext():
        for name, (high, low) in operands.items():
            if isinstance(low, Fp8Tensor):
                scale = low.scale  # a tensorwise scale is its own smallest
                scale_probes.append((name, scale.amin() if scale.dim() else scale))
            elif high is not None and high.numel():
                end_probes.append((name, torch.aminmax(high)))
        if output.numel():
            # aminmax: one vectorized pass without a copy; NaN propagates through it.
            end_probes.append((output_name, torch.aminmax(output)))
        stats = _stats(operands, output) if observer.sampling else None
    observer.observe(layer, role, scale_probes, end_probes, stats)


def _stats(operands: Mapping[str, Operand], output: torch.Tensor) -> torch.Tensor:
    """The :data:`STATS` of one GEMM, as a float32 vector on the output's device.

    Each operand is read in a few passes: its magnitude in float32 once, then masks of
    it (``<= float32 max`` is False for inf and NaN alike); an FP8 element is zero when
    its bits other than the sign are, read as bytes. Counts are summed at the end, in
    one stack.
    """
    device = output.device
    counts: dict[str, list[torch.Tensor]] = {key: [] for key in STATS}
    counts["nonfinite"].append(output.numel() - torch.count_nonzero(torch.isfinite(output)))
    counts["amax"].append(torch.zeros((), dtype=torch.float32, device=device))
    for high, low in operands.values():
        magnitude = None
        if high is not None and high.numel():
            magnitude = high.detach().abs().float()
            finite = magnitude <= _F32_MAX
            counts["nonfinite"].append(magnitude.numel() - torch.count_nonzero(finite))
            counts["amax"].append(torch.where(finite, magnitude, 0.0).amax())
        if isinstance(low, BlockTensor):
            block = _block_counts(magnitude, low)
            for key, value in zip(_BLOCK_COUNTS, block, strict=True):
                counts[key].append(value)
            continue
        if low is None:
            continue
        dtype_max = torch.finfo(low.data.dtype).max
        scale = low.scale.float()
        counts["scale_clamps"].append(
            torch.count_nonzero((scale >= dtype_max / EPS) | (scale <= 2.0**-126))
        )
        counts["elements"].append(torch.tensor(float(low.data.numel()), device=device))
        if magnitude is not None and magnitude.shape == low.data.shape:
            nonzero = magnitude != 0  # NaN included, as the cast makes it non-zero
            counts["nonzero"].append(torch.count_nonzero(nonzero))
            counts["underflow"].append(torch.count_nonzero(_fp8_zero(low.data) & nonzero))
            counts["saturated"].append(torch.count_nonzero(magnitude * scale > dtype_max))
    zero = torch.zeros((), dtype=torch.float32, device=device)
    row = []
    for key, values in counts.items():
        stacked = torch.stack([value.float() for value in values]) if values else zero
        row.append(stacked.amax() if key == "amax" else stacked.sum())
    return torch.stack(row)


_F32_MAX = torch.finfo(torch.float32).max
_BLOCK_COUNTS = ("underflow", "nonzero", "saturated", "elements", "scale_clamps")


def _fp8_zero(data: torch.Tensor) -> torch.Tensor:
    """Where an FP8 tensor holds +0 or -0 (its bits other than the sign are 0)."""
    return torch.logical_not(data.view(torch.uint8) & 0x7F)


_E8M0_LARGEST = 254  # the largest finite E8M0 exponent (255 is NaN)
_E4M3_FLOOR = 2.0**-6  # NVFP4's smallest block scale


def _block_counts(magnitude: torch.Tensor | None, low: BlockTensor) -> tuple[torch.Tensor, ...]:
    """(underflow, nonzero, saturated, elements, scale clamps) of one block operand."""
    fmt = low.format
    if fmt.is_mx:
        bits = low.scale_bits
        clamps = torch.count_nonzero((bits == 0) | (bits == _E8M0_LARGEST)).float()
    else:
        clamps = torch.count_nonzero(low.block_scale() == _E4M3_FLOOR).float()
    elements = torch.tensor(float(low.elements.numel()), device=clamps.device)
    if magnitude is None or magnitude.shape != low.elements.shape:
        zero = torch.zeros((), dtype=torch.float32, device=clamps.device)
        return zero, zero, zero, elements, clamps
    scale = low.block_scale()
    if low.tensor_scale is not None:
        scale = scale * low.tensor_scale
    limit = (scale * fmt.elem_max).repeat_interleave(fmt.block_size, dim=-1)
    nonzero = magnitude != 0
    underflow = torch.count_nonzero((low.elements == 0) & nonzero).float()
    nonzero = torch.count_nonzero(nonzero).float()
    saturated = torch.count_nonzero(magnitude > limit).float()
    return underflow, nonzero, saturated, elements, clamps
