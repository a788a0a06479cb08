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
kernel on a CPU (:mod:`amped.lowp.float8.fp8_kernel` run by
:func:`amped.lowp.float8.compiled_cast.run`; eager for tensors under its
``MIN_ELEMENTS``): the amax pass, the scales (one number
per tensor or row) and the cast pass, one hand-off to the cast worker. The same
function gives the same bits eagerly (tests/lowp/float8/test_fp8_cast_compiled.py): a maximum is
exact in any order, the scale is the eager one (:func:`amped.lowp.float8.fp8_kernel.scale_of`
says why), and the cast is one float32 product, a clamp and one rounding.

For an emulated GEMM (:mod:`amped.lowp.float8.gemm`) the cast writes the FP8 values as the
GEMM's operand instead of the bytes (``values_dtype``: bfloat16 or float32, both exact
for every e4m3 and e5m2 value), rounding to the FP8 grid with float32 arithmetic
(:func:`fp8_grid`) rather than converting to FP8 and back: Inductor's CPU code converts
float32 to and from FP8 with long integer sequences (e5m2 one element at a time), which
made a cast several times a copy's cost. The bytes of such a cast are computed from
its values when first read (:attr:`Float8Tensor.data`; exact), which an emulated training
step never does.
"""

from __future__ import annotations

import torch

from amped._internal.errors import value_error
from amped.lowp.float8 import compiled_cast, fp8_kernel
from amped.lowp.float8.fp8_kernel import EPS, Granularity, fp8_grid

__all__ = [
    "EPS",
    "FP8_DTYPES",
    "Float8Tensor",
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


class Float8Tensor:
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
                "an Float8Tensor holds its FP8 data, or its values and FP8 dtype to compute "
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
            values, scale = self.values, self.scale
            self._data = compiled_cast.run(fp8_kernel.bytes_of_values, spec, values, scale)
        return self._data

    @property
    def shape(self) -> torch.Size:
        """The shape of ``data`` (read without computing it)."""
        return self._data.shape if self._data is not None else self.values.shape  # type: ignore[union-attr]

    def t(self) -> Float8Tensor:
        """The transpose of a 2-D quantized tensor (data, scale and values together)."""
        scale = self.scale.t() if self.scale.dim() == 2 else self.scale
        values = None if self.values is None else self.values.t()
        data = None if self._data is None else self._data.t()
        return Float8Tensor(data, scale, values, self.dequantized, self.dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data / scale`` in ``dtype`` (computed in float32)."""
        return (self.data.to(torch.float32) / self.scale).to(dtype)


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
    return compiled_cast.run(fp8_kernel.amax_kernel, (granularity, dim), x)


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
    return fp8_kernel.scale_of(amax, dtype, power_of_2)


def cast_saturated(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x * scale`` in float32, clamped to ``dtype``'s finite range, rounded to ``dtype``.

    Saturating first matters: a plain ``.to(float8_e4m3fn)`` of a value past the
    largest finite one gives NaN on older torch, and e5m2 would give inf.
    """
    check_fp8_dtype(dtype)
    return compiled_cast.run(fp8_kernel.bytes_kernel, dtype, x, scale)


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
) -> Float8Tensor:
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
        scale, cast = compiled_cast.run(fp8_kernel.cast_kernel, spec, x)
        if values_dtype is None:
            return Float8Tensor(cast, scale)
        return _operand(x, dtype, scale, cast, power_of_2)
    if values_dtype is None:
        return Float8Tensor(compiled_cast.run(fp8_kernel.bytes_kernel, dtype, x, scale), scale)
    values = compiled_cast.run(fp8_kernel.values_kernel, (dtype, values_dtype), x, scale)
    return _operand(x, dtype, scale, values, False)


def _operand(
    x: torch.Tensor,
    dtype: torch.dtype,
    scale: torch.Tensor,
    values: torch.Tensor,
    dequantized: bool,
) -> Float8Tensor:
    """The :class:`Float8Tensor` of a cast of ``x`` that wrote ``values``; its bytes too where
    an inf or NaN made a power-of-two scale 0 or NaN (``values / scale`` is then 0 / 0:
    the values cannot give the bytes back)."""
    data = None
    if dequantized and not bool((scale > 0).all()):
        data = compiled_cast.run(fp8_kernel.bytes_kernel, dtype, x, scale)
    return Float8Tensor(data, scale, values, dequantized, dtype)


@torch.no_grad()
def quantize_rows_and_columns(
    x: torch.Tensor, dtype: torch.dtype, power_of_2: bool, values_dtype: torch.dtype | None
) -> tuple[Float8Tensor, Float8Tensor]:
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
        fp8_kernel.rows_and_columns_kernel, spec, x
    )
    rows = _operand(x, dtype, row_scale, row_values, power_of_2)
    return rows, _operand(x, dtype, column_scale, column_values, power_of_2)


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
