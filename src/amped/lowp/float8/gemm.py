"""The FP8 GEMM: ``torch._scaled_mm`` on FP8 GPUs, an exact emulation elsewhere (CPUs).

``scaled_mm(a, b)`` computes ``(a.data / a.scale) @ (b.data / b.scale)`` for a
``[M, K]`` operand ``a`` and a ``[K, N]`` operand ``b``. ``torch._scaled_mm`` takes
the *inverse* scales (it multiplies), wants ``a`` row-major and ``b`` column-major,
and pairs either two tensorwise scales or two rowwise ones (``a``: ``[M, 1]``, ``b``:
``[1, N]``); a tensorwise scale meeting a rowwise one is therefore broadcast to a
vector first. Rowwise kernels write bfloat16 only: a float32 or float16 result is
computed in bfloat16 and then converted, on every path, so that emulation and
hardware round the same way.

The emulation (every CPU) multiplies the FP8 *values* and applies the scales to the
result, as the block GEMMs do (:mod:`amped.lowp.mx.block_gemm`)::

    out = round_to_out((values_a @ values_b) * inv_a * inv_b)

The values of e4m3 and e5m2 (at most 4 significant bits) are exact in bfloat16 and
float32, so every product in the GEMM is exact. The GEMM's dtype follows the output
and the device (:func:`gemm_dtype`):

- **bfloat16 or float16 output** (every FP8 recipe: their bases are bfloat16) on a
  device with native bfloat16 matmul (:mod:`amped.lowp.float8.emulated_gemm`): a
  bfloat16 ``mm`` of bfloat16 values. oneDNN accumulates it in float32 (AMX and
  AVX512-BF16 on CPUs: 21 against 128 ms for a float32 GEMM of 2048 x 512 @ 512 x 2048
  on one thread, docs/decisions/003-emulated-gemm.md) and rounds the sum once to bfloat16; the
  scales then multiply that in float32 and the result is rounded to the output dtype,
  a second rounding. So against an FP8 kernel (torch's CPU ``_scaled_mm``, which
  torchao calls, or a GPU's), which scales the float32 sum and rounds once, the
  emulation differs by float32 summation order and by that extra bfloat16 rounding
  (at most one bfloat16 ulp more; 51 dB against torchao's tensorwise layer).
- **bfloat16 or float16 output on a device without** (an AVX2 CPU, whose bfloat16
  ``mm`` is software, 10-100 times a float32 one): a float32 ``mm`` of float32 values,
  the scales applied to its float32 sums and the result rounded once, as an FP8 kernel
  does (80-112 dB against torchao's tensorwise layer: summation order only).
- **float32 output**: a float32 ``mm`` of float32 values, the float32 sum scaled in
  float32: exact products, float32 sums, no bfloat16 rounding (rowwise pairs still
  round to bfloat16, as torch's rowwise kernels write only bfloat16).

Where an operand's scale is a power of two that its cast computed (every rowwise rule,
and tensorwise with ``power_of_2``), the cast writes its values already divided by the
scale (:attr:`~amped.lowp.float8.cast.Float8Tensor.dequantized`; exact), so that scale is not
applied after the GEMM. A power-of-two factor commutes with every rounding short of
float32's subnormal range, so this gives the bits of scaling after; with both scales
folded the GEMM's one rounding is the only one (the rowwise layers match torchao's
bitwise).

The values come from the cast (:func:`~amped.lowp.float8.cast.quantize` with
``values_dtype``, written by the cast's own pass) or, for an operand cast without them
(a weight FSDP2 all-gathered as FP8 bytes, a caller's own :class:`Float8Tensor`), from
one compiled conversion. tests/lowp/float8/test_fp8_torchao.py holds the emulation to
40 dB of SQNR against torchao, tests/lowp/float8/test_fp8_cast.py to the bound of
float32 accumulation plus these roundings around the exact float64 product.
"""

from __future__ import annotations

import functools

import torch

from amped._internal import torch_compat
from amped.lowp.float8 import compiled_cast
from amped.lowp.float8.cast import Float8Tensor
from amped.lowp.float8.emulated_gemm import emulated_gemm

__all__ = [
    "gemm_dtype",
    "has_scaled_mm",
    "high_precision_mm",
    "operand_values",
    "pad_inner",
    "scaled_mm",
]


@functools.cache
def has_scaled_mm(device: torch.device) -> bool:
    """Whether ``device`` has FP8 GEMM hardware that ``torch._scaled_mm`` uses.

    CUDA: compute capability 8.9 (Ada) or 9.0+ (Hopper, Blackwell). CPUs: no; torch's
    CPU ``_scaled_mm`` gains nothing over the emulation and on AMX-INT8 CPUs is far
    slower (docs/fp8.md), so FP8 layers emulate on CPU unless told not to.
    """
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return False


def _pair_scales(a: Float8Tensor, b: Float8Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse scales in the shapes ``_scaled_mm`` pairs (both scalars, or both vectors)."""
    inv_a, inv_b = a.scale.reciprocal(), b.scale.reciprocal()
    a_rows, b_cols = inv_a.dim() == 2, inv_b.dim() == 2
    if a_rows and not b_cols:
        inv_b = inv_b.reshape(1, 1).expand(1, b.shape[1]).contiguous()
    elif b_cols and not a_rows:
        inv_a = inv_a.reshape(1, 1).expand(a.shape[0], 1).contiguous()
    return inv_a, inv_b


def pad_inner(
    a: Float8Tensor, b: Float8Tensor, multiple: int = 16
) -> tuple[Float8Tensor, Float8Tensor]:
    """``a`` and ``b`` with zeros appended along the inner dim to a multiple of ``multiple``.

    CUDA's ``_scaled_mm`` needs both dims of ``b`` divisible by 16; in the grad-weight
    GEMM the inner dim is the number of tokens, which a user chooses freely. Zero
    columns of ``a`` meet zero rows of ``b``: the products they add are exact zeros, so
    the result is unchanged. (Scales are per tensor or per outer row/column: unchanged.)
    """
    k = a.data.shape[1]
    extra = -k % multiple
    if extra == 0:
        return a, b
    a_data = a.data.new_zeros(a.data.shape[0], k + extra)
    a_data[:, :k] = a.data
    b_data = b.data.new_zeros(k + extra, b.data.shape[1])
    b_data[:k] = b.data
    return Float8Tensor(a_data, a.scale), Float8Tensor(b_data, b.scale)


def scaled_mm(
    a: Float8Tensor,
    b: Float8Tensor,
    out_dtype: torch.dtype,
    *,
    emulate: bool = False,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """``dequantize(a) @ dequantize(b)`` rounded to ``out_dtype``, as an FP8 GEMM.

    Args:
        a: ``[M, K]`` FP8 operand, tensorwise (scalar scale) or rowwise (``[M, 1]``).
        b: ``[K, N]`` FP8 operand, tensorwise or column-wise (``[1, N]``).
        out_dtype: float32, bfloat16 or float16.
        emulate: multiply the FP8 values (exact products, float32 sums) in
            :func:`gemm_dtype` and scale the result (see the module) instead of calling
            ``_scaled_mm``.
        use_fast_accum: let the kernel accumulate in reduced precision (Hopper's
            fast-accumulation mode; ignored on CPU and by the emulation).
    """
    inv_a, inv_b = _pair_scales(a, b)
    rowwise = inv_a.dim() == 2
    result_dtype = torch.bfloat16 if rowwise else out_dtype
    if emulate:
        dtype = gemm_dtype(out_dtype, a.scale.device)
        out = operand_values(a, dtype) @ operand_values(b, dtype)
        left = [inv for inv, x in ((inv_a, a), (inv_b, b)) if not _dequantized(x, dtype)]
        if left:
            out = compiled_cast.run(_scale_result, result_dtype, out, *left)
        else:  # both folded into the operands: the GEMM's result is the result
            out = out.to(result_dtype)
    else:
        if (
            a.data.device.type == "cpu"
            and rowwise
            and not torch_compat.cpu_scaled_mm_takes_rowwise()
        ):
            raise RuntimeError(
                "torch's CPU _scaled_mm takes row-wise scales from torch 2.12 on; this is "
                f"torch {torch.__version__}. Use emulate=True (exact, the CPU default) or "
                "tensorwise scales, or upgrade torch."
            )
        if a.data.device.type == "cuda":
            a, b = pad_inner(a, b)
        a_data = a.data if a.data.is_contiguous() else a.data.contiguous()
        b_data = b.data if b.data.t().is_contiguous() else b.data.t().contiguous().t()
        out = torch_compat.scaled_mm(a_data, b_data, inv_a, inv_b, result_dtype, use_fast_accum)
    return out if out.dtype is out_dtype else out.to(out_dtype)


def gemm_dtype(out_dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype an emulated FP8 or block GEMM on ``device`` with an ``out_dtype`` result
    multiplies in: float32 for a float32 result, else the device's
    :func:`~amped.lowp.float8.emulated_gemm.emulated_gemm` (bfloat16 where it multiplies
    bfloat16 natively, float32 where not; see the module)."""
    if out_dtype is torch.float32:
        return torch.float32
    return emulated_gemm(device).dtype


def high_precision_mm(a: torch.Tensor, b: torch.Tensor, emulate: bool) -> torch.Tensor:
    """``a @ b`` in their dtype: the GEMM a recipe keeps in high precision
    (``fp8-rowwise-gw-hp``'s grad-weight GEMM). An emulating layer on a device whose
    emulated GEMMs run in float32 (no native bfloat16 matmul,
    :mod:`amped.lowp.float8.emulated_gemm`) computes a bfloat16 one as the float32 GEMM of the
    same operands (exact in float32) rounded once to bfloat16: what the bfloat16 GEMM
    computes (float32 sums rounded once), up to summation order, without its software
    emulation."""
    if emulate and a.dtype is torch.bfloat16 and gemm_dtype(a.dtype, a.device) is torch.float32:
        return (a.to(torch.float32) @ b.to(torch.float32)).to(a.dtype)
    return a @ b


def operand_values(x: Float8Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x``'s FP8 values in ``dtype`` (exact): those its cast wrote, or converted now
    (compiled on a CPU: torch's eager FP8 conversion is scalar code, some 15 ns an
    element)."""
    if x.values is not None and x.values.dtype is dtype:
        return x.values
    return compiled_cast.run(_convert, dtype, x.data)


def _dequantized(x: Float8Tensor, dtype: torch.dtype) -> bool:
    """Whether :func:`operand_values` gives ``x``'s values divided by its scale already."""
    return x.dequantized and x.values is not None and x.values.dtype is dtype


def _convert(dtype: torch.dtype, x: torch.Tensor) -> torch.Tensor:
    """Through float32, exact: Inductor's direct float8 -> bfloat16 code is scalar."""
    return x.to(torch.float32).to(dtype)


def _scale_result(dtype: torch.dtype, out: torch.Tensor, *inverses: torch.Tensor) -> torch.Tensor:
    """``out`` times the inverse scales left to apply (one or two; one float32 rounding
    each), rounded to ``dtype``: one pass."""
    scaled = out.to(torch.float32)
    for inverse in inverses:
        scaled = scaled * inverse
    return scaled.to(dtype)
