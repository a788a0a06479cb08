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

- every step, per tensor, a :class:`Probe`: device data that tells whether the tensor
  held an inf or NaN. A quantized operand's probe is what its cast computed anyway,
  so it costs no pass over the tensor; an output's is made by :func:`range_probe`
  (one pass, see there);
- on the steps it samples (``observer.sampling``), the counts in :data:`STATS`.

**What a cast shows** (checked in ``tests/lowp/test_monitor_probes.py``):

- FP8 (:class:`~amped.lowp.float8.cast.Float8Tensor`): the scale, bad unless ``0 < scale < inf``.
  A dynamic scale is ``fp8_max / amax``: 0 for an inf amax, NaN for a NaN one; a
  delayed one is made NaN by :func:`amped.lowp.float8.delayed.propagate_nonfinite`. Rowwise:
  per row, so one bad row shows.
- Blockwise FP8 (:class:`~amped.lowp.float8.blockwise.BlockwiseTensor`): each tile's
  ``scale_inv``, bad unless ``0 < scale_inv < inf`` (an inf tile's scale is 0, its
  ``scale_inv`` inf; a NaN tile's NaN): one bad tile shows.
- MX (:class:`~amped.lowp.mx.block_cast.BlockTensor`, E8M0 scales): the scale bits, bad
  from the exponent an inf block takes (:func:`nonfinite_exponent`; a NaN block takes
  255, the E8M0 NaN). Under ``floor`` and ``rceil`` scales no finite block reaches it:
  exact. Under ``ceil`` and ``even`` a finite block whose amax rounds up to ``2**128``
  (``ceil``: amax above ``2**127``; ``even``: amax at least ``(2 - 2**-(m+1)) * 2**127``
  for elements of ``m`` mantissa bits) shares the inf block's exponent and is
  reported too.
- NVFP4: the float32 tensor scale, ``amax / (448 * 6)`` of the whole operand: inf or
  NaN with it (the block scales saturate an inf, so they cannot tell).

**Total underflow**: a cast whose input held a non-zero element and whose every
element is zero (the GEMM then sees an all-zero operand: that GEMM's output, or the
layer's gradient, is lost without an inf or NaN). Judged per cast, never per block
(healthy NVFP4 training flushes single small blocks routinely). NVFP4 is where it
hides: its tensor scale floors the amax at ``1e-30`` and its E4M3 block scales at
``2**-6``, so an operand whose magnitudes are all below about ``1.45e-36`` (a quarter
of ``2**-6 * 1e-30 / 2688``) rounds to zero whole. Its probe carries
:data:`NVFP4_FLOOR_SCALE` as ``floor``: a tensor scale at it (amax at most ``1e-30``)
is the one state a total underflow needs, and :func:`floored` tests that with the
step's other probes; only then does :func:`flushes_to_zero` decide, from the
operand itself.

A probe is only as good as the scale's link to the data: an operand quantized with a
scale passed in (not from its own amax) must make that scale NaN itself where the data
is not finite, as delayed scaling does. An operand passed without a quantized form
(``fp8-rowwise-gw-hp``'s grad-weight GEMM runs in high precision) is not probed: its
inf or NaN reaches the GEMM's output, which is (and the same tensors were probed by
this layer's casts earlier in the step).

Any layer can report the same way: call ``record_gemm(self, role, output_name, output,
{operand_name: (high, quantized)})`` after each GEMM, with ``quantized`` an
:class:`~amped.lowp.float8.cast.Float8Tensor` (its ``scale`` multiplies, ``data`` is the
low-precision payload), a :class:`~amped.lowp.mx.block_cast.BlockTensor` (and
``scale_mode=`` the MX scale rule it was cast with) or None, and ``high`` the tensor
before the cast or None.

The sampled counters of a block operand read its block scales: an element saturates
when its magnitude exceeds the format's largest element times its block's scale
(times NVFP4's tensor scale); a *scale clamp* is a block scale at the format's floor
(E8M0 ``2**-127``, NVFP4's ``2**-6``) or at E8M0's largest finite value.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple, Protocol

import torch

from amped.lowp.float8.blockwise import BlockwiseTensor
from amped.lowp.float8.cast import EPS, Float8Tensor
from amped.lowp.mx.block_cast import BlockTensor, quantize_block
from amped.lowp.mx.block_format import BLOCK_FORMATS, BlockFormat, ScaleMode
from amped.lowp.mx.block_kernel import NVFP4_AMAX_FLOOR

__all__ = [
    "NVFP4_FLOOR_SCALE",
    "ROLES",
    "STATS",
    "GemmObserver",
    "Operand",
    "Probe",
    "any_nonfinite",
    "floored",
    "flushes_to_zero",
    "nonfinite_exponent",
    "probe_nonfinite",
    "range_probe",
    "record_gemm",
]

ROLES = ("forward", "grad_input", "grad_weight")
"""The three GEMMs of a linear layer, in the order a training step runs them."""

STATS = (
    "nonfinite",  # elements that are inf or NaN, in the operands and the output
    "underflow",  # non-zero operand elements the cast made zero
    "nonzero",  # non-zero operand elements (underflow's denominator)
    "saturated",  # operand elements the cast clamped to the format's largest value
    "elements",  # operand elements cast (saturated's denominator)
    "scale_clamps",  # scales at a clamp: amax below EPS, or a delayed scale at a bound
    "amax",  # the largest magnitude among the operands (inf/NaN when one held one)
)
"""The sampled counters of one GEMM, in this order (float32, summed; ``amax``: max)."""

Operand = tuple[torch.Tensor | None, Float8Tensor | BlockwiseTensor | BlockTensor | None]

ProbeKind = Literal["scale", "exponent", "range"]

NVFP4_FLOOR_SCALE = float(torch.tensor(NVFP4_AMAX_FLOOR, dtype=torch.float32) / (448.0 * 6.0))
"""NVFP4's tensor scale of an operand whose amax is at most ``1e-30`` (float32, as the
cast computes it): about ``3.72e-34``."""


class Probe(NamedTuple):
    """Device data that tells whether one tensor of a GEMM held an inf or NaN.

    Attributes:
        kind: ``"scale"``: float scales, bad unless ``0 < scale < inf``;
            ``"exponent"``: E8M0 scale bits (uint8), bad from ``threshold`` up;
            ``"range"``: the tensor's min and max, bad unless finite.
        values: the tensors (any shape; ``"range"``: the min and the max).
        threshold: ``"exponent"`` only: :func:`nonfinite_exponent` of the cast.
        floor: an NVFP4 cast's: :data:`NVFP4_FLOOR_SCALE`, the tensor scale
            (``values[0]``) at which a total underflow is possible (see the module); 0
            for other probes.
    """

    kind: ProbeKind
    values: tuple[torch.Tensor, ...]
    threshold: int = 0
    floor: float = 0.0


def _bad(kind: ProbeKind, values: torch.Tensor, threshold: int) -> torch.Tensor:
    """Where ``values`` of a probe of ``kind`` say inf or NaN (elementwise, bool)."""
    if kind == "scale":  # log is finite exactly where 0 < scale < inf (not at NaN)
        return ~torch.isfinite(torch.log(values))
    if kind == "exponent":
        return values >= threshold
    return ~torch.isfinite(values)


def range_probe(tensor: torch.Tensor) -> Probe | None:
    """The probe of a tensor no cast has scaled (a GEMM's output, a gradient), or None
    when the host knows already that it holds no inf or NaN.

    On an accelerator the probe is the tensor's min and max (one ``aminmax`` pass, the
    cheapest exact check there is), left on the device for the step's one batched test:
    reading it here would stall the device once per GEMM. On the CPU there is nothing to
    wait for, so the answer is read at once from a cheaper detector, the tensor's
    ``sum()`` (2-2.5x faster than ``aminmax`` on bfloat16): it is finite whenever every
    element is, so a finite sum means a finite tensor (None). A sum that is not finite
    comes from an inf or NaN, or from finite values summing past the dtype's range
    (float32's for a bfloat16 or float32 tensor, float16's for a float16 one): only then,
    while the tensor is still alive, ``aminmax`` checks exactly, and a finite tensor is
    None again. Either way the probe is exact: no false "non-finite", none missed.
    """
    if tensor.device.type != "cpu":
        return Probe("range", tuple(torch.aminmax(tensor)))
    if math.isfinite(float(tensor.sum())):
        return None
    low, high = torch.aminmax(tensor)  # the exact re-check, while the tensor is alive
    if math.isfinite(float(low)) and math.isfinite(float(high)):
        return None  # finite values whose sum overflowed
    return Probe("range", (low, high))


def probe_nonfinite(probe: Probe) -> bool:
    """Whether ``probe`` says its tensor held an inf or NaN (syncs with the device)."""
    return any(bool(_bad(probe.kind, v, probe.threshold).any()) for v in probe.values)


def any_nonfinite(probes: Sequence[Probe]) -> torch.Tensor:
    """Whether any of ``probes`` says inf or NaN: a 0-d bool tensor on the first probe's
    device, with no sync.

    The same test as :func:`probe_nonfinite`, on the probes' values joined per kind of
    probe (and dtype): a few ops whatever the number of probes.
    """
    device = probes[0].values[0].device
    groups: dict[tuple[ProbeKind, int, torch.dtype], list[torch.Tensor]] = {}
    for probe in probes:
        for value in probe.values:
            key = (probe.kind, probe.threshold, value.dtype)
            groups.setdefault(key, []).append(value)
    flags = []
    for (kind, threshold, _), values in groups.items():
        if any(value.device != device for value in values):
            values = [value.to(device) for value in values]
        if all(value.dim() == 0 for value in values):  # scalars: one stack, no reshapes
            joined = torch.stack(values)
        else:
            joined = torch.cat([value.reshape(-1) for value in values])
        flags.append(_bad(kind, joined, threshold).any())
    return torch.stack(flags).any()


def floored(probes: Sequence[Probe]) -> torch.Tensor | None:
    """For each NVFP4 probe among ``probes`` (those with a ``floor``, in order), whether
    its tensor scale is at the floor (a total underflow is possible there, see the
    module): a 1-D bool tensor, no sync; None when no probe has a floor. One stack and
    one comparison of 0-d scales."""
    scales = [probe.values[0] for probe in probes if probe.floor]
    if not scales:
        return None
    device = scales[0].device
    if any(scale.dim() or scale.device != device for scale in scales):
        scales = [scale.reshape(()).to(device) for scale in scales]
    return torch.stack(scales) <= NVFP4_FLOOR_SCALE


def flushes_to_zero(high: torch.Tensor, tensor_scale: torch.Tensor) -> bool:
    """Whether an NVFP4 cast that rounds to nearest, with ``tensor_scale``, makes every
    element of ``high`` zero while ``high`` holds a non-zero one: a total underflow
    (one pass over ``high``; syncs with its device).

    Exact from the largest magnitude alone, without the cast's elements: the block that
    holds it gets the largest block scale, ``e4m3(clamp(amax / 6 / tensor_scale, 2**-6,
    448))``. Above the ``2**-6`` floor its amax maps to about 6, not zero; at the floor
    every block is at it too (their amaxes are smaller), so all share one multiplier and
    round to zero exactly when the largest magnitude does. That one value is cast as
    the only non-zero element of a block, with the same tensor scale.
    (Stochastic rounding draws per element: no value decides it.)
    """
    amax = high.detach().abs().amax().to(torch.float32)
    if not bool(amax > 0):  # all zero (nothing lost), or NaN (not an underflow)
        return False
    block = torch.zeros(BLOCK_FORMATS["nvfp4"].block_size, device=amax.device)
    block[0] = amax
    cast = quantize_block(block, BLOCK_FORMATS["nvfp4"], tensor_scale=tensor_scale.float())
    return not bool(cast.elements[0] != 0)


@functools.cache
def nonfinite_exponent(fmt: BlockFormat, scale_mode: ScaleMode) -> int:
    """The E8M0 exponent an MX cast gives a block holding an inf (NaN: 255, above it).

    Found by running the cast (:func:`~amped.lowp.mx.block_cast.quantize_block`) on one
    such block: ``floor``, ``ceil`` and ``even`` give ``255 - emax``, ``rceil`` 254.
    """
    block = torch.zeros(fmt.block_size)
    block[0] = math.inf
    return int(quantize_block(block, fmt, scale_mode).scale_bits[0])


def _cast_probe(
    low: Float8Tensor | BlockwiseTensor | BlockTensor | None, scale_mode: ScaleMode
) -> Probe | None:
    """The probe of a quantized operand: data its cast computed (see the module)."""
    if isinstance(low, Float8Tensor):
        return Probe("scale", (low.scale,))
    if isinstance(low, BlockwiseTensor):
        return Probe("scale", (low.scale_inv,))
    if isinstance(low, BlockTensor):
        if low.tensor_scale is not None:  # NVFP4
            return Probe("scale", (low.tensor_scale,), floor=NVFP4_FLOOR_SCALE)
        threshold = nonfinite_exponent(low.format, scale_mode)
        return Probe("exponent", (low.scale_bits,), threshold)
    return None


class GemmObserver(Protocol):
    """What :func:`record_gemm` reports to (``layer.fp8_observer``).

    An observer that also has ``capture_gemm(layer, role, output, operands)`` is handed
    the GEMM's output and operands (each ``(high, quantized)`` as :func:`record_gemm`
    got them) instead, and no probes: :func:`amped.verify` reads the casts so. An
    observer may also have a ``recorder`` (not None) whose ``keep(layer, role, operands,
    output_name, output)`` receives the GEMM's tensors themselves
    (``amped.monitor(record=...)``).
    """

    sampling: bool

    def observe(
        self,
        layer: torch.nn.Module,
        role: str,
        probes: list[tuple[str, Probe]],
        stats: torch.Tensor | None,
    ) -> None:
        """``probes``: (tensor name, its probe), operands first, then the output;
        ``stats``: :data:`STATS` on a sampled step, else None."""


def record_gemm(
    layer: torch.nn.Module,
    role: str,
    output_name: str,
    output: torch.Tensor,
    operands: Mapping[str, Operand],
    *,
    scale_mode: ScaleMode = "rceil",
) -> None:
    """Report one GEMM of ``layer`` to its observer, if it has one (see the module).

    ``scale_mode``: the rule MX block operands' scales were cast with.
    """
    observer: Any = getattr(layer, "fp8_observer", None)
    if observer is None:
        return
    capture = getattr(observer, "capture_gemm", None)
    if capture is not None:  # an observer of the operands themselves (amped.verify)
        capture(layer, role, output, operands)
        return
    probes = []
    for name, (_, low) in operands.items():
        probe = _cast_probe(low, scale_mode)
        if probe is not None:
            probes.append((name, probe))
    # A GEMM runs inside an autograd Function, where grad mode is off already.
    with torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext():
        output_probe = range_probe(output.detach()) if output.numel() else None
        if output_probe is not None:
            probes.append((output_name, output_probe))
        stats = None
        if observer.sampling:
            # On the CPU, where reading a device value waits for nothing, the host knows
            # which tensors are finite (their probes) and can skip counts it knows are 0.
            finite = None
            if output.device.type == "cpu":
                finite = {name for name, probe in probes if not probe_nonfinite(probe)}
                finite |= {output_name} if output_probe is None else set()
            stats = _stats(operands, output, output_name, finite)
    observer.observe(layer, role, probes, stats)
    recorder = getattr(observer, "recorder", None)
    if recorder is not None:  # amped.monitor(record=...): references, no copy
        recorder.keep(layer, role, operands, output_name, output)


def _stats(
    operands: Mapping[str, Operand],
    output: torch.Tensor,
    output_name: str,
    finite: set[str] | None,
) -> torch.Tensor:
    """The :data:`STATS` of one GEMM, as a float32 vector on the output's device.

    Built from the passes a CPU runs fastest (measured: comparisons, ``isfinite`` and
    ``where`` cost 3-10 times a multiply or a sum), on the tensors the cast produced
    where they tell the count:

    - non-finite elements: the non-zero elements of ``tensor * 0`` (inf and NaN give NaN),
      counted only for the tensors not in ``finite`` (the names the host knows hold
      none; None where it cannot read the device without waiting: all counted);
    - underflow: the operand's non-zero elements minus the quantized form's (a cast
      keeps zero as zero and NaN as NaN, so the difference is the non-zero elements it
      made zero; exact unless a scale is NaN, where it counts fewer);
    - saturated: ``|high| * scale > largest`` (an FP8 scale) or ``|high| > largest *
      block scale`` (a block operand, per block without a copy of the scales). Where the
      host reads the device for free, an FP8 operand in which every scale's slice (the
      tensor, a row or a column) has ``slice amax * scale <= largest`` has none
      (rounding is monotonic, so no element's product exceeds its slice's) and is not
      counted: most dynamic and delayed scales;
    - amax: the largest magnitude (inf or NaN when the operand held one).

    Counts stay on the device; they are stacked at the end, with no sync.
    """
    device = output.device
    sums: list[torch.Tensor] = [torch.zeros((), dtype=torch.float32, device=device)]
    rows: list[int] = [STATS.index("nonfinite")]
    amaxes = [torch.zeros((), dtype=torch.float32, device=device)]
    elements = 0

    def add(stat: str, value: torch.Tensor) -> None:
        sums.append(value)
        rows.append(STATS.index(stat))

    if finite is None or output_name not in finite:
        add("nonfinite", _count_nonfinite(output.detach().abs()))
    read_now = finite is not None
    for name, (high, low) in operands.items():
        magnitude = None
        if high is not None and high.numel():
            magnitude = high.detach().abs()
            if finite is None or name not in finite:
                add("nonfinite", _count_nonfinite(magnitude))
        if isinstance(low, BlockTensor):
            elements += low.elements.numel()
            counts, amax = _block_counts(magnitude, low, read_now)
            for stat, value in counts.items():
                add(stat, value)
            if amax is not None:
                amaxes.append(amax)
            continue
        if low is None:
            if magnitude is not None:
                amaxes.append(magnitude.amax())
            continue
        if isinstance(low, BlockwiseTensor):
            elements += low.shape.numel()
            for stat, value in _blockwise_counts(magnitude, low).items():
                add(stat, value)
            if magnitude is not None:
                amaxes.append(magnitude.amax())
            continue
        # shape and dtype without the bytes, which a cast that wrote only values (every
        # emulated step) computes in a pass of their own when read (Float8Tensor.data)
        elements += low.shape.numel()
        dtype_max = torch.finfo(low.dtype).max
        scale = low.scale.float()
        add("scale_clamps", torch.count_nonzero((scale >= dtype_max / EPS) | (scale <= 2.0**-126)))
        if magnitude is not None and magnitude.shape == low.shape:
            nonzero = _count_nonzero(magnitude)  # NaN included: the cast keeps it
            kept = _count_nonzero_fp8(low.data)
            add("nonzero", nonzero)
            add("underflow", (nonzero - kept).clamp(min=0))
            # The largest magnitude under each scale: the same pass as one amax.
            per_scale = magnitude.amax(dim=_dims_of_one(scale, magnitude), keepdim=True)
            amaxes.append(per_scale.max())
            # NaN (an operand holding one) is not <= dtype_max: counted.
            if not read_now or not float((per_scale.float() * scale).max()) <= dtype_max:
                add("saturated", torch.count_nonzero(magnitude * scale > dtype_max))
        elif magnitude is not None:  # an operand without its quantized form's shape
            amaxes.append(magnitude.amax())
    # One stack and one indexed add for all the counts (dtypes promoted to float32).
    row = torch.zeros(len(STATS), dtype=torch.float32, device=device)
    row.index_add_(0, torch.tensor(rows, device=device), torch.stack(sums).float())
    row[STATS.index("elements")] = float(elements)
    row[-1] = torch.stack(amaxes).amax()
    return row


def _blockwise_counts(
    magnitude: torch.Tensor | None, low: BlockwiseTensor
) -> dict[str, torch.Tensor]:
    """The counts of one blockwise FP8 operand: scale clamps (a tile's scale at the
    amax floor or below float32's normal range, as for a tensorwise scale), and with its
    high-precision ``magnitude`` its non-zero, underflowed and saturated elements
    (``|high| > fp8_max * scale_inv`` of its tile: beyond what the tile's E4M3 holds)."""
    dtype_max = torch.finfo(low.data.dtype).max
    scale = 1.0 / low.scale_inv
    counts = {
        "scale_clamps": torch.count_nonzero((scale >= dtype_max / EPS) | (scale <= 2.0**-126))
    }
    if magnitude is None or magnitude.shape != low.shape:
        return counts
    nonzero = _count_nonzero(magnitude)
    counts["nonzero"] = nonzero
    counts["underflow"] = (nonzero - _count_nonzero_fp8(low.data)).clamp(min=0)
    limit = low.scale_inv_per_element() * dtype_max
    counts["saturated"] = torch.count_nonzero(magnitude > limit)
    return counts


_SAME_SIZE_INT = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}


def _count_nonzero(magnitude: torch.Tensor) -> torch.Tensor:
    """The non-zero (NaN included) elements of a tensor without a sign bit set (an
    ``abs()``), counted on its bits: a third of the float count's cost on a CPU."""
    return torch.count_nonzero(magnitude.view(_SAME_SIZE_INT[magnitude.dtype]))


def _count_nonfinite(magnitude: torch.Tensor) -> torch.Tensor:
    """The inf and NaN elements of an ``abs()``: ``x * 0`` is NaN there, +0 elsewhere
    (a multiply and a count on the bits: a fifth of ``isfinite`` and a count)."""
    return _count_nonzero(magnitude * 0)


def _count_nonzero_fp8(data: torch.Tensor) -> torch.Tensor:
    """The elements of an FP8 tensor other than +-0: its bytes with a bit other than the
    sign set, counted on the bytes (no wider copy)."""
    return torch.count_nonzero(data.view(torch.uint8) & 0x7F)


_E8M0_LARGEST = 254  # the largest finite E8M0 exponent (255 is NaN)
_E4M3_FLOOR = 2.0**-6  # NVFP4's smallest block scale


def _dims_of_one(scale: torch.Tensor, tensor: torch.Tensor) -> list[int]:
    """The dims of ``tensor`` one value of ``scale`` covers (all of them for one scale)."""
    if scale.dim() != tensor.dim():
        return list(range(tensor.dim()))
    return [dim for dim, size in enumerate(scale.shape) if size == 1] or [tensor.dim() - 1]


def _block_counts(
    magnitude: torch.Tensor | None, low: BlockTensor, read_now: bool
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """The counts of one block operand: its scale clamps, and with its high-precision
    ``magnitude`` its non-zero, underflowed and saturated elements; and the magnitude's
    largest element (None without one).

    Where the host reads the device for free (``read_now``), the saturated elements are
    counted only if a block's largest magnitude exceeds its limit (none saturates
    otherwise); the per-block maxima take the pass a plain ``amax`` would."""
    fmt = low.format
    scale = low.block_scale()
    bits = low.scale_bits
    if fmt.is_mx:
        clamps = torch.count_nonzero((bits == 0) | (bits == _E8M0_LARGEST))
    else:
        clamps = torch.count_nonzero(scale == _E4M3_FLOOR)
    if magnitude is None or magnitude.shape != low.elements.shape:
        return {"scale_clamps": clamps}, None if magnitude is None else magnitude.amax()
    if low.tensor_scale is not None:
        scale = scale * low.tensor_scale
    limit = scale * fmt.elem_max  # per block
    nonzero = _count_nonzero(magnitude)
    blocks = magnitude.unflatten(-1, (-1, fmt.block_size))
    block_amax = blocks.amax(-1)
    counts = {
        "nonzero": nonzero,
        "underflow": (nonzero - _count_nonzero(low.elements.abs())).clamp(min=0),
        "scale_clamps": clamps,
    }
    # NaN (a block holding one, or a NaN scale) is not <= its limit: counted.
    if not read_now or not bool((block_amax <= limit).all()):
        counts["saturated"] = torch.count_nonzero(blocks > limit.unsqueeze(-1))
    return counts, block_amax.max()
