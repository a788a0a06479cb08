"""FP8 casts: amax, scale, and the saturating cast to ``float8_e4m3fn`` / ``float8_e5m2``.

A quantized tensor is ``data = saturate(x * scale)`` in an FP8 dtype; ``x`` is recovered
(up to rounding) as ``data / scale``. The scale maps the tensor's largest magnitude,
its amax, onto the largest finite value of the FP8 dtype::

    scale = float32(fp8_max / max(float64(amax), 1e-12))
    scale = 2 ** floor(log2(scale))          # only with power_of_2=True

The division is done in float64 because ``fp8_max / amax`` overflows float32 for an
amax below about 1e-36 and loses the last bit of the quotient otherwise; rounding
the float64 quotient once to float32 gives the same scale on every device. A scale
rounded down to a power of two makes ``x * scale`` and ``data / scale`` exact in
binary floating point, so only the FP8 rounding itself loses information.

Tensorwise scaling uses one scale per tensor; rowwise one per row (or column) of a
2-D operand, the scale tensor keeping the reduced dim as size 1.

A cast by the tensor's own amax (:func:`quantize` without a ``scale``) is one compiled
kernel on a CPU (:func:`amped.fp8.compiled_cast.run`; eager for tensors under its
``MIN_ELEMENTS``): the amax pass, the scales (one number per tensor or row) and the
cast pass, one hand-off to the cast worker. The same function gives the same bits
eagerly (tests/test_fp8_cast_compiled.py): a maximum is exact in any order, the scale
is the eager one (:func:`_scale_of` says why), and the cast is one float32 product, a
clamp and one rounding.

For an emulated GEMM (:mod:`amped.fp8.gemm`) the cast writes the FP8 values as the
GEMM's operand instead of the bytes (``values_dtype``: bfloat16 or float32, both exact
for every e4m3 and e5m2 value), rounding to the FP8 grid with float32 arithmetic
(:func:`fp8_grid`) rather than converting to FP8 and back: Inductor's CPU code converts
float32 to and from FP8 with long integer sequences (e5m2 one element at a time), which
made a cast several times a copy's cost. The bytes of such a cast are computed from
its values when first read (:attr:`Fp8Tensor.data`; exact), which an emulated training
step never does.
"""

from __future__ import annotations

from typing import Literal

import torch

from amped._internal.errors import value_error
from amped.fp8 import compiled_cast

__all__ = [
    "EPS",
    "FP8_DTYPES",
    "Fp8Tensor",
    "Granularity",
    "amax_of",
    "amax_to_scale",
    "cast_saturated",
    "check_fp8_dtype",
    "check_granularity",
    "check_values_dtype",
    "fp8_grid",
    "quantize",
    "quantize_rows_and_columns",
    "sqnr",
]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
EPS = 1e-12
"""Smallest amax a scale is computed from: an all-zero tensor gets a finite scale."""

Granularity = Literal["tensorwise", "rowwise"]


class Fp8Tensor:
    """FP8 ``data`` with the ``scale`` it was multiplied by (``x ~= data / scale``).

    ``scale`` is a float32 scalar (tensorwise) or has ``data``'s shape with the reduced
    dim of size 1 (rowwise). ``values``, when the cast was asked for them
    (``values_dtype``), is the operand an emulated GEMM multiplies, in bfloat16 or
    float32: the FP8 values exactly, or, where ``dequantized`` (a power-of-two scale
    the cast computed), divided by the scale, also exact; None otherwise.

    A cast that wrote ``values`` wrote no bytes (unless an inf or NaN made a
    power-of-two scale 0 or NaN, where the values cannot give them back): ``data`` is
    computed from the values on first read (``dtype`` names the FP8 dtype then), the
    same bits the cast would have written.
    """

    __slots__ = ("_data", "dequantized", "dtype", "scale", "values")

    def __init__(
        self,
        data: torch.Tensor | None,
        scale: torch.Tensor,
        values: torch.Tensor | None = None,
        dequantized: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        if data is None and (values is None or dtype is None):
            raise value_error(
                "an Fp8Tensor holds its FP8 data, or its values and FP8 dtype to compute "
                "the data from",
                "data",
                data,
            )
        self._data = data
        self.scale = scale
        self.values = values
        self.dequantized = dequantized
        self.dtype: torch.dtype = data.dtype if data is not None else dtype  # type: ignore[assignment]

    @property
    def data(self) -> torch.Tensor:
        """The FP8 bytes (computed from ``values`` on first read where the cast wrote none)."""
        if self._data is None:
            assert self.values is not None  # __init__ holds one of the two
            spec = (self.dtype, self.dequantized)
            self._data = compiled_cast.run(_bytes_of_values, spec, self.values, self.scale)
        return self._data

    @property
    def shape(self) -> torch.Size:
        """The shape of ``data`` (read without computing it)."""
        return self._data.shape if self._data is not None else self.values.shape  # type: ignore[union-attr]

    def t(self) -> Fp8Tensor:
        """The transpose of a 2-D quantized tensor (data, scale and values together)."""
        scale = self.scale.t() if self.scale.dim() == 2 else self.scale
        values = None if self.values is None else self.values.t()
        data = None if self._data is None else self._data.t()
        return Fp8Tensor(data, scale, values, self.dequantized, self.dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data / scale`` in ``dtype`` (computed in float32)."""
        return (self.data.to(torch.float32) / self.scale).to(dtype)


def _bytes_of_values(
    spec: tuple[torch.dtype, bool], values: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """The FP8 bytes of a cast's ``values``: exact, as each value is an FP8 value (times a
    power-of-two inverse scale, undone here, where dequantized)."""
    dtype, dequantized = spec
    exact = values.to(torch.float32)
    return (exact * scale if dequantized else exact).to(dtype)


def check_fp8_dtype(dtype: torch.dtype) -> None:
    """Refuse a dtype that is not an FP8 one."""
    if dtype not in FP8_DTYPES:
        names = ", ".join(str(d) for d in FP8_DTYPES)
        raise value_error(f"FP8 casts target {names}", "dtype", dtype)


def check_granularity(granularity: str) -> None:
    """Refuse a scaling granularity other than ``"tensorwise"`` and ``"rowwise"``."""
    if granularity not in ("tensorwise", "rowwise"):
        raise value_error(
            "FP8 scaling granularity is 'tensorwise' or 'rowwise'", "granularity", granularity
        )


@torch.no_grad()
def amax_of(
    x: torch.Tensor, granularity: Granularity = "tensorwise", dim: int = -1
) -> torch.Tensor:
    """The largest magnitude of ``x``: a scalar, or per slice along ``dim`` (kept as size 1).

    Computed in ``x``'s own dtype: the maximum of magnitudes is exact in any dtype.
    """
    check_granularity(granularity)
    return compiled_cast.run(_amax_kernel, (granularity, dim), x)


def _amax_kernel(spec: tuple[Granularity, int], x: torch.Tensor) -> torch.Tensor:
    return _amax(x, *spec)


def _amax(x: torch.Tensor, granularity: Granularity, dim: int) -> torch.Tensor:
    magnitude = x.abs()
    if granularity == "tensorwise":
        return magnitude.max()
    if magnitude.dim() == 2 and dim in (0, -2):
        return _column_amax(magnitude)
    return magnitude.amax(dim=dim, keepdim=True)


_ROW_BLOCK = 16


def _column_amax(magnitude: torch.Tensor) -> torch.Tensor:
    """``magnitude.amax(dim=0, keepdim=True)`` of a 2-D tensor, over blocks of 16 rows
    first and then over the blocks' maxima: the same maximum (exact in any order), in a
    loop Inductor writes row by row. Its loop for the plain form walks each 32-column
    strip down every row, one cache line per row: twice the time (a 2048 x 2048 bfloat16
    operand at one thread, 1.3 against 0.6 ms; docs/history/fp8-speed.md)."""
    rows, columns = magnitude.shape
    head = rows - rows % _ROW_BLOCK
    if head == 0:
        return magnitude.amax(dim=0, keepdim=True)
    blocks = magnitude[:head].reshape(head // _ROW_BLOCK, _ROW_BLOCK, columns).amax(dim=1)
    if head < rows:
        blocks = torch.cat([blocks, magnitude[head:]])
    return blocks.amax(dim=0, keepdim=True)


@torch.no_grad()
def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype, power_of_2: bool = False) -> torch.Tensor:
    """The float32 scale that maps ``amax`` onto ``dtype``'s largest finite value.

    Args:
        amax: largest magnitudes (any shape, any floating dtype).
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        power_of_2: round each scale down to a power of two.

    Example:
        >>> import torch
        >>> amax_to_scale(torch.tensor(2.0), torch.float8_e4m3fn)
        tensor(224.)
    """
    check_fp8_dtype(dtype)
    return _scale_of(amax, dtype, power_of_2)


def _scale_of(amax: torch.Tensor, dtype: torch.dtype, power_of_2: bool) -> torch.Tensor:
    """:func:`amax_to_scale`, also run inside the cast kernels (:func:`_cast_kernel`).

    Compiled, the same bits: Inductor writes the float64 quotient as a reciprocal times
    ``fp8_max`` (two float64 roundings, a relative error under 2**-52), but the exact
    quotient of ``fp8_max`` by a float32 amax is never closer than 2**-49 (relative) to
    a float32 rounding boundary, so the float32 scale is the same; and ``log2``,
    ``floor`` and ``exp2`` give the same power of two whether at::vec's vectorized
    ``log2`` or the scalar ``std::log2`` computes it, for every positive float32
    (checked over all of them: docs/history/fp8-speed.md).
    """
    fp8_max = torch.finfo(dtype).max
    scale = (fp8_max / amax.to(torch.float64).clamp(min=EPS)).to(torch.float32)
    if power_of_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def cast_saturated(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x * scale`` in float32, clamped to ``dtype``'s finite range, rounded to ``dtype``.

    Saturating first matters: a plain ``.to(float8_e4m3fn)`` of a value past the
    largest finite one gives NaN on older torch, and e5m2 would give inf.
    """
    check_fp8_dtype(dtype)
    return compiled_cast.run(_bytes_kernel, dtype, x, scale)


def _saturated(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    fp8_max = torch.finfo(dtype).max
    return (x.to(torch.float32) * scale).clamp(min=-fp8_max, max=fp8_max)


def _bytes_kernel(dtype: torch.dtype, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The FP8 bytes of ``x * scale``, saturated: one loop."""
    return _saturated(x, scale, dtype).to(dtype)


def _values_kernel(
    spec: tuple[torch.dtype, torch.dtype], x: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """:func:`_values` with a scale given (the delayed scaling path): one loop."""
    return _values(x, scale, *spec)


def _values(
    x: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    values_dtype: torch.dtype,
    inverse: torch.Tensor | None = None,
    own_amax: bool = False,
) -> torch.Tensor:
    """The FP8 values of ``x * scale``, saturated, in ``values_dtype``, times ``inverse``
    (``1 / scale``) where given: the same values as converting the bytes of
    :func:`_bytes_kernel`. The inverse of a power-of-two scale is exact, so multiplying
    by it is dividing by the scale; a product is three times faster than a division per
    element in Inductor's loop.

    ``own_amax``: ``scale`` was computed from ``x``'s own amax (:func:`_scale_of`), so no
    product exceeds the FP8 maximum by more than the scale's rounding: the float32
    quotient rounds up by at most half an ulp, and ``log2`` rounds up to the next
    integer only within 2**-18 (relative) below a power of two, while a value rounds
    past the maximum only from halfway to the next grid value (464 = 448 * 29/28 for
    e4m3, 61440 = 57344 * 15/14 for e5m2). The rounding then gives the clamp's values, so the
    clamp (two operations of some twenty per element) is left out; NaN and the
    0 * inf of an infinite amax stay NaN either way."""
    product = x.to(torch.float32) * scale
    values = fp8_grid(product if own_amax else _saturated(x, scale, dtype), dtype)
    if inverse is not None:
        values = values * inverse
    return values.to(values_dtype)


def _cast_kernel(
    spec: tuple[torch.dtype, Granularity, int, bool, torch.dtype | None], x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale and the cast of ``x`` by its own amax: the bytes, or (``values_dtype``)
    the values, divided by a power-of-two scale. Amax, scale and cast in one compiled
    kernel: one hand-off to the cast worker instead of two, and for one scale per row
    the row is read again from cache (:func:`_scale_of` holds the scale to eager's bits)."""
    dtype, granularity, dim, power_of_2, values_dtype = spec
    scale = _scale_of(_amax(x, granularity, dim), dtype, power_of_2)
    if values_dtype is None:
        return scale, _saturated(x, scale, dtype).to(dtype)
    inverse = scale.reciprocal() if power_of_2 else None
    return scale, _values(x, scale, dtype, values_dtype, inverse, own_amax=True)


def fp8_grid(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``v.to(dtype).to(torch.float32)`` for float32 ``v`` within ``dtype``'s finite
    range, computed with float32 arithmetic only (bit for bit the same, NaN, signed
    zeros and subnormals included; tests/test_fp8_cast.py checks every rounding case).

    Normal range: Veltkamp's splitting, ``g = v * (2**s + 1); v_hi = g - (g - v)``, is
    ``v`` rounded to nearest, ties to even, on ``24 - s`` significant bits, either sign
    (exact float32 operations, no overflow below 2**100); ``s = 23 - mantissa bits``.
    Below the smallest normal FP8 value the grid is fixed, multiples of ``q`` = the
    smallest subnormal: ``(v + c) - c`` with ``c = 1.5 * q * 2**23`` rounds ``v`` to it
    (the sum lies in ``[q * 2**23, q * 2**24)``, where float32's ulp is ``q``; ``c / q``
    is even, so ties go to even). That sum loses the sign of a value rounded to zero, so
    zeros take ``v * 0`` (-0 for a negative ``v``, as the conversion gives). Both need the
    compiler to keep each operation as written: the cast kernels are compiled with
    reassociation and FMA contraction off whatever the environment says
    (:data:`amped.fp8.compiled_cast.EXACT_FLOATING_POINT`), and
    tests/test_fp8_cast_compiled.py holds compiled to eager. (Signed, the rounding is
    some 11 vector operations per element against 13 on magnitudes with the sign
    restored.)
    """
    mantissa_bits, min_exponent = (3, -6) if dtype is torch.float8_e4m3fn else (2, -14)
    split = v * float(2 ** (23 - mantissa_bits) + 1)
    normal = split - (split - v)
    shift = 1.5 * 2.0 ** (min_exponent - mantissa_bits + 23)
    subnormal = (v + shift) - shift
    rounded = torch.where(v.abs() < 2.0**min_exponent, subnormal, normal)
    return torch.where(rounded == 0, v * 0.0, rounded)  # -0 for a negative v


def check_values_dtype(values_dtype: torch.dtype | None) -> None:
    """Refuse a GEMM operand dtype other than bfloat16 and float32 (the exact ones)."""
    if values_dtype not in (None, torch.bfloat16, torch.float32):
        raise value_error(
            "FP8 values are written exactly as torch.bfloat16 or torch.float32 (or None: "
            "no values)",
            "values_dtype",
            values_dtype,
        )


@torch.no_grad()
def quantize(
    x: torch.Tensor,
    dtype: torch.dtype,
    granularity: Granularity = "tensorwise",
    dim: int = -1,
    power_of_2: bool = False,
    scale: torch.Tensor | None = None,
    values_dtype: torch.dtype | None = None,
) -> Fp8Tensor:
    """Quantize ``x`` to ``dtype`` with a scale from its own amax, or the ``scale`` given.

    For rowwise scaling, ``dim`` is the dim reduced over (``-1``: one scale per row).
    ``values_dtype`` (bfloat16 or float32): write the FP8 values in it instead of the
    bytes (``.values``, the operand of an emulated GEMM; ``.data`` is computed from them
    when read); with ``power_of_2`` and no ``scale`` given, divided by their power-of-two
    scale (``.dequantized``): exact (a scale is at most ``2**59``), and the GEMM then has
    no scales left to apply.

    Example:
        >>> import torch
        >>> q = quantize(torch.tensor([0.5, -3.0]), torch.float8_e4m3fn, power_of_2=True)
        >>> q.scale, q.dequantize()
        (tensor(128.), tensor([ 0.5000, -3.0000]))
    """
    check_fp8_dtype(dtype)
    check_values_dtype(values_dtype)
    if scale is None:
        spec = (dtype, granularity, dim, power_of_2, values_dtype)
        scale, cast = compiled_cast.run(_cast_kernel, spec, x)
        if values_dtype is None:
            return Fp8Tensor(cast, scale)
        return _operand(x, dtype, scale, cast, power_of_2)
    if values_dtype is None:
        return Fp8Tensor(compiled_cast.run(_bytes_kernel, dtype, x, scale), scale)
    values = compiled_cast.run(_values_kernel, (dtype, values_dtype), x, scale)
    return _operand(x, dtype, scale, values, False)


def _operand(
    x: torch.Tensor,
    dtype: torch.dtype,
    scale: torch.Tensor,
    values: torch.Tensor,
    dequantized: bool,
) -> Fp8Tensor:
    """The :class:`Fp8Tensor` of a cast of ``x`` that wrote ``values``; its bytes too where
    an inf or NaN made a power-of-two scale 0 or NaN (``values / scale`` is then 0 / 0:
    the values cannot give the bytes back)."""
    data = None
    if dequantized and not bool((scale > 0).all()):
        data = compiled_cast.run(_bytes_kernel, dtype, x, scale)
    return Fp8Tensor(data, scale, values, dequantized, dtype)


@torch.no_grad()
def quantize_rows_and_columns(
    x: torch.Tensor, dtype: torch.dtype, power_of_2: bool, values_dtype: torch.dtype | None
) -> tuple[Fp8Tensor, Fp8Tensor]:
    """``quantize(x, dtype, "rowwise", dim, power_of_2, values_dtype=values_dtype)`` for
    ``dim=-1`` and ``dim=0`` of a 2-D ``x``: the same bits, in two passes over ``x``
    instead of four where the casts write GEMM operands (both amaxes, then both operands,
    in one kernel). A rowwise grad_output is cast both ways in one backward."""
    check_fp8_dtype(dtype)
    check_values_dtype(values_dtype)
    if values_dtype is None or x.dim() != 2:
        rows = quantize(x, dtype, "rowwise", -1, power_of_2, None, values_dtype)
        return rows, quantize(x, dtype, "rowwise", 0, power_of_2, None, values_dtype)
    spec = (dtype, power_of_2, values_dtype)
    row_scale, column_scale, row_values, column_values = compiled_cast.run(
        _rows_and_columns_kernel, spec, x
    )
    rows = _operand(x, dtype, row_scale, row_values, power_of_2)
    return rows, _operand(x, dtype, column_scale, column_values, power_of_2)


def _rows_and_columns_kernel(
    spec: tuple[torch.dtype, bool, torch.dtype], x: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """:func:`_cast_kernel` along the last dim and along dim 0, one kernel: the row and
    column scales, then the row and column values (the values in one loop)."""
    dtype, power_of_2, values_dtype = spec
    row_scale = _scale_of(_amax(x, "rowwise", -1), dtype, power_of_2)
    column_scale = _scale_of(_amax(x, "rowwise", 0), dtype, power_of_2)
    row_inverse = row_scale.reciprocal() if power_of_2 else None
    column_inverse = column_scale.reciprocal() if power_of_2 else None
    rows = _values(x, row_scale, dtype, values_dtype, row_inverse, own_amax=True)
    columns = _values(x, column_scale, dtype, values_dtype, column_inverse, own_amax=True)
    return row_scale, column_scale, rows, columns


def sqnr(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``approx`` against ``reference``, in dB.

    ``20 * log10(||reference|| / ||reference - approx||)``, norms in float64; inf when
    the two are equal. 20 dB is a 10% relative error in the L2 norm, 40 dB 1%.
    """
    ref = reference.detach().to(torch.float64)
    noise = torch.linalg.vector_norm(ref - approx.detach().to(torch.float64))
    if noise == 0:
        return float("inf")
    return float(20 * torch.log10(torch.linalg.vector_norm(ref) / noise))
