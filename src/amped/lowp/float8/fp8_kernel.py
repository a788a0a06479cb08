"""The FP8 casts' kernels: pure functions of tensors that :mod:`amped.lowp.float8.cast` runs through
:func:`amped.lowp.float8.compiled_cast.run` (compiled on a CPU, eager elsewhere; the same bits).

Each takes ``(spec, x, *tensors)``: ``spec`` the static settings of one compiled kernel.
:func:`cast_kernel` is a whole cast by the tensor's own amax (amax, scale, cast);
:func:`rows_and_columns_kernel` casts a 2-D tensor along both dims at once;
:func:`values_kernel` and :func:`bytes_kernel` cast with a scale given (delayed
scaling); :func:`amax_kernel` is the amax alone. :func:`fp8_grid` is the rounding they
share: float32 arithmetic only, which the kernels are compiled to keep as written
(:data:`amped.lowp.float8.compiled_cast.EXACT_FLOATING_POINT`).
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = [
    "EPS",
    "ROW_BLOCK",
    "Granularity",
    "amax",
    "amax_kernel",
    "bytes_kernel",
    "bytes_of_values",
    "cast_kernel",
    "column_amax",
    "fp8_grid",
    "fp8_values",
    "rows_and_columns_kernel",
    "saturated",
    "scale_of",
    "values_kernel",
]

EPS = 1e-12
"""Smallest amax a scale is computed from: an all-zero tensor gets a finite scale."""

Granularity = Literal["tensorwise", "rowwise"]


def bytes_of_values(
    spec: tuple[torch.dtype, bool], values: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """The FP8 bytes of a cast's ``values``: exact, as each value is an FP8 value (times a
    power-of-two inverse scale, undone here, where dequantized)."""
    dtype, dequantized = spec
    exact = values.to(torch.float32)
    return (exact * scale if dequantized else exact).to(dtype)


def amax_kernel(spec: tuple[Granularity, int], x: torch.Tensor) -> torch.Tensor:
    """:func:`amax` alone (``spec``: granularity and dim)."""
    return amax(x, *spec)


def amax(x: torch.Tensor, granularity: Granularity, dim: int) -> torch.Tensor:
    """The largest magnitude of ``x``: a scalar, or per slice along ``dim`` (kept)."""
    magnitude = x.abs()
    if granularity == "tensorwise":
        return magnitude.max()
    if magnitude.dim() == 2 and dim in (0, -2):
        return column_amax(magnitude)
    return magnitude.amax(dim=dim, keepdim=True)


ROW_BLOCK = 16


def column_amax(magnitude: torch.Tensor) -> torch.Tensor:
    """``magnitude.amax(dim=0, keepdim=True)`` of a 2-D tensor, over blocks of 16 rows
    first and then over the blocks' maxima: the same maximum (exact in any order), in a
    loop Inductor writes row by row. Its loop for the plain form walks each 32-column
    strip down every row, one cache line per row: twice the time (a 2048 x 2048 bfloat16
    operand at one thread, 1.3 against 0.6 ms, Intel Xeon with AVX512-BF16)."""
    rows, columns = magnitude.shape
    head = rows - rows % ROW_BLOCK
    if head == 0:
        return magnitude.amax(dim=0, keepdim=True)
    blocks = magnitude[:head].reshape(head // ROW_BLOCK, ROW_BLOCK, columns).amax(dim=1)
    if head < rows:
        blocks = torch.cat([blocks, magnitude[head:]])
    return blocks.amax(dim=0, keepdim=True)


def scale_of(amax: torch.Tensor, dtype: torch.dtype, power_of_2: bool) -> torch.Tensor:
    """:func:`amped.lowp.float8.cast.amax_to_scale`, also run inside the cast kernels
    (:func:`cast_kernel`).

    Compiled, the same bits: Inductor writes the float64 quotient as a reciprocal times
    ``fp8_max`` (two float64 roundings, a relative error under 2**-52), but the exact
    quotient of ``fp8_max`` by a float32 amax is never closer than 2**-49 (relative) to
    a float32 rounding boundary, so the float32 scale is the same; and ``log2``,
    ``floor`` and ``exp2`` give the same power of two whether at::vec's vectorized
    ``log2`` or the scalar ``std::log2`` computes it, for every positive float32
    (checked over all of them once, by running both on every positive float32).
    """
    fp8_max = torch.finfo(dtype).max
    scale = (fp8_max / amax.to(torch.float64).clamp(min=EPS)).to(torch.float32)
    if power_of_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def saturated(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x * scale`` in float32, clamped to ``dtype``'s finite range."""
    fp8_max = torch.finfo(dtype).max
    return (x.to(torch.float32) * scale).clamp(min=-fp8_max, max=fp8_max)


def bytes_kernel(dtype: torch.dtype, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The FP8 bytes of ``x * scale``, saturated: one loop."""
    return saturated(x, scale, dtype).to(dtype)


def values_kernel(
    spec: tuple[torch.dtype, torch.dtype], x: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """:func:`fp8_values` with a scale given (the delayed scaling path): one loop."""
    return fp8_values(x, scale, *spec)


def fp8_values(
    x: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    values_dtype: torch.dtype,
    inverse: torch.Tensor | None = None,
    own_amax: bool = False,
) -> torch.Tensor:
    """The FP8 values of ``x * scale``, saturated, in ``values_dtype``, times ``inverse``
    (``1 / scale``) where given: the same values as converting the bytes of
    :func:`bytes_kernel`. The inverse of a power-of-two scale is exact, so multiplying
    by it is dividing by the scale; a product is three times faster than a division per
    element in Inductor's loop.

    ``own_amax``: ``scale`` was computed from ``x``'s own amax (:func:`scale_of`), so no
    product exceeds the FP8 maximum by more than the scale's rounding: the float32
    quotient rounds up by at most half an ulp, and ``log2`` rounds up to the next
    integer only within 2**-18 (relative) below a power of two, while a value rounds
    past the maximum only from halfway to the next grid value (464 = 448 * 29/28 for
    e4m3, 61440 = 57344 * 15/14 for e5m2). The rounding then gives the clamp's values,
    so the clamp (two operations of some twenty per element) is left out; NaN and the
    0 * inf of an infinite amax stay NaN either way."""
    product = x.to(torch.float32) * scale
    values = fp8_grid(product if own_amax else saturated(x, scale, dtype), dtype)
    if inverse is not None:
        values = values * inverse
    return values.to(values_dtype)


def cast_kernel(
    spec: tuple[torch.dtype, Granularity, int, bool, torch.dtype | None], x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale and the cast of ``x`` by its own amax: the bytes, or (``values_dtype``)
    the values, divided by a power-of-two scale. Amax, scale and cast in one compiled
    kernel (Inductor writes the amax loop, a loop over the scales and the cast loop):
    one hand-off to the cast worker instead of two, and no eager ops between them
    (:func:`scale_of` holds the scale to eager's bits)."""
    dtype, granularity, dim, power_of_2, values_dtype = spec
    if values_dtype is None:
        scale = scale_of(amax(x, granularity, dim), dtype, power_of_2)
        return scale, bytes_kernel(dtype, x, scale)
    return _own_amax_values(x, granularity, dim, dtype, power_of_2, values_dtype)


def _own_amax_values(
    x: torch.Tensor,
    granularity: Granularity,
    dim: int,
    dtype: torch.dtype,
    power_of_2: bool,
    values_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale of ``x`` by its own amax and its :func:`fp8_values`, divided by the
    scale where that is a power of two (exact)."""
    scale = scale_of(amax(x, granularity, dim), dtype, power_of_2)
    inverse = scale.reciprocal() if power_of_2 else None
    return scale, fp8_values(x, scale, dtype, values_dtype, inverse, own_amax=True)


def fp8_grid(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``v.to(dtype).to(torch.float32)`` for float32 ``v`` within ``dtype``'s finite
    range, computed with float32 arithmetic only (bit for bit the same, NaN, signed
    zeros and subnormals included; tests/lowp/float8/test_fp8_cast.py checks every rounding case).

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
    (:data:`amped.lowp.float8.compiled_cast.EXACT_FLOATING_POINT`), and
    tests/lowp/float8/test_fp8_cast_compiled.py holds compiled to eager. (Signed, the rounding is
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


def rows_and_columns_kernel(
    spec: tuple[torch.dtype, bool, torch.dtype], x: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """:func:`cast_kernel` along the last dim and along dim 0, one kernel: the row and
    column scales, then the row and column values (the values in one loop)."""
    dtype, power_of_2, values_dtype = spec
    row_scale, rows = _own_amax_values(x, "rowwise", -1, dtype, power_of_2, values_dtype)
    column_scale, columns = _own_amax_values(x, "rowwise", 0, dtype, power_of_2, values_dtype)
    return row_scale, column_scale, rows, columns
