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
float32 result: ``(float32(a.data) @ float32(b.data)) * inv_a * inv_b``, rounded to
``out_dtype`` once. The matmul runs in oneDNN's bfloat16 math mode
(``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``, set around that call only):
oneDNN converts its float32 inputs to bfloat16, which is exact for FP8 values (e4m3
and e5m2 have at most 3 mantissa bits), multiplies them exactly and accumulates in
float32, at about twice the cost of a bfloat16 GEMM and under half that of a float32
one on an AMX CPU (docs/history/fp8-speed.md). A CPU without bfloat16 units runs the
same call as an ordinary float32 matmul: the same exact products. So every product is
exact and the result differs from an FP8 kernel's (torch's CPU ``_scaled_mm``, which
torchao calls, or a GPU's) only in the order its float32 sums are taken and in where
the scales are applied; tests/test_fp8_torchao.py holds it to 40 dB of SQNR against
torchao and to the float32-accumulation bound of the exact float64 product.
"""

from __future__ import annotations

import functools

import torch

from amped._internal import torch_compat
from amped.fp8 import compiled_cast
from amped.fp8.cast import Fp8Tensor

__all__ = ["has_scaled_mm", "pad_inner", "scaled_mm"]


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


def _pair_scales(a: Fp8Tensor, b: Fp8Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse scales in the shapes ``_scaled_mm`` pairs (both scalars, or both vectors)."""
    inv_a, inv_b = a.scale.reciprocal(), b.scale.reciprocal()
    a_rows, b_cols = inv_a.dim() == 2, inv_b.dim() == 2
    if a_rows and not b_cols:
        inv_b = inv_b.reshape(1, 1).expand(1, b.data.shape[1]).contiguous()
    elif b_cols and not a_rows:
        inv_a = inv_a.reshape(1, 1).expand(a.data.shape[0], 1).contiguous()
    return inv_a, inv_b


def pad_inner(a: Fp8Tensor, b: Fp8Tensor, multiple: int = 16) -> tuple[Fp8Tensor, Fp8Tensor]:
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
    return Fp8Tensor(a_data, a.scale), Fp8Tensor(b_data, b.scale)


def scaled_mm(
    a: Fp8Tensor,
    b: Fp8Tensor,
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
        emulate: multiply the FP8 values exactly with float32 sums and scale the result
            (see the module) instead of calling ``_scaled_mm``.
        use_fast_accum: let the kernel accumulate in reduced precision (Hopper's
            fast-accumulation mode; ignored on CPU and by the emulation).
    """
    inv_a, inv_b = _pair_scales(a, b)
    rowwise = inv_a.dim() == 2
    gemm_dtype = torch.bfloat16 if rowwise else out_dtype
    if emulate:
        out = _values_mm(a.data, b.data)
        out = compiled_cast.run(_scale_result, gemm_dtype, out, inv_a, inv_b)
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
        out = torch_compat.scaled_mm(a_data, b_data, inv_a, inv_b, gemm_dtype, use_fast_accum)
    return out if out.dtype is out_dtype else out.to(out_dtype)


def _values_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of two FP8 tensors' values: exact products, float32 sums, float32 result.

    On a CPU the float32 matmul runs in oneDNN's bfloat16 math mode, set for this call
    only (a global flag of torch's: another thread's float32 matmul running at this
    very moment would also get it); the bfloat16 conversion is exact for FP8 values.
    Inside a ``torch.compile`` trace (where the flag cannot be set) and off CPU it is a
    plain float32 matmul: the same exact products, summed by another kernel.
    """
    a32 = compiled_cast.run(_to_float32, None, a)
    b32 = compiled_cast.run(_to_float32, None, b)
    if a.device.type != "cpu" or torch.compiler.is_compiling():
        return a32 @ b32
    matmul = torch.backends.mkldnn.matmul  # type: ignore[attr-defined]  # set at import
    previous = matmul.fp32_precision
    matmul.fp32_precision = "bf16"
    try:
        return a32 @ b32
    finally:
        matmul.fp32_precision = previous


def _to_float32(spec: None, x: torch.Tensor) -> torch.Tensor:
    """FP8 values in float32 (exact). Compiled on a CPU (amped.fp8.compiled_cast): torch's
    eager FP8 conversion is scalar code, some 15 ns an element."""
    return x.to(torch.float32)


def _scale_result(
    dtype: torch.dtype, out: torch.Tensor, inv_a: torch.Tensor, inv_b: torch.Tensor
) -> torch.Tensor:
    """``out * inv_a * inv_b`` (two float32 roundings) rounded to ``dtype``: one pass."""
    return (out * inv_a * inv_b).to(dtype)
