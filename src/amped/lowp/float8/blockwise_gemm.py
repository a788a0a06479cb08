"""The blockwise FP8 GEMM: per-128-block scales along the inner dim, as DeepSeek-V3 runs it.

``blockwise_mm(a, b)`` computes ``dequantize(a) @ dequantize(b)`` for an ``[M, K]``
operand ``a`` whose tiles are 128 long along K (``1 x 128`` or ``128 x 128``) and a
``[K, N]`` operand ``b`` whose tiles are 128 long along K (``128 x 1`` or
``128 x 128``): within a block of 128 inner indices every product has the same two
scales, so the GEMM runs block by block and scales each block's sums::

    out = round_to_out(sum over k-blocks kb of
                       (values_a[:, kb] @ values_b[kb, :])
                       * (scale_inv_a[:, kb] * scale_inv_b[kb, :]))

which is what DeepGEMM and ``torch._scaled_mm``'s blockwise kernels do on Hopper
(partial sums of FP8 products promoted to float32 at each block, times the product of
the two scales, accumulated in float32).

**Emulation** (every device without the kernel, CPUs): the same loop in float32. The
FP8 values are exact in float32 and so is each product (two 4-bit significands); each
block's sum of at most 128 products is a float32 GEMM (oneDNN: float32 accumulation),
then one rounding for the scales' product, one for the scaling and one per block added:
with ``u = 2**-24`` and ``KB`` blocks, against the exact sum of the dequantized products,
``|out - exact| <= (128 + KB + 1) * u * sum_k |a_k * b_k|`` to first order, before the
final rounding to ``out_dtype`` (half an ulp of it). tests/lowp/float8/test_fp8_blockwise_gemm.py
holds layer outputs and gradients to that bound against a float64 GEMM of the same
operands. With power-of-two scales (``power_of_2=True``) the scalings are exact and only
the sums round.

**Kernel** (CUDA, compute capability 9.x, every dim a multiple of 128, a torch with
``torch.nn.functional.scaled_mm``): ``scaled_mm`` with ``BlockWise1x128`` and
``BlockWise128x128`` scaling, the operands and scale layouts as torchao's
``blockwise_fp8_training`` passes them. It has not run yet (no Hopper GPU where it was
written), so a layer uses it only when asked (``Float8Linear.convert_(...,
emulate=False)``), and then only for GEMMs that :func:`kernel_fits`;
tests/lowp/float8/test_fp8_blockwise_gemm.py holds it to the emulation's bound on a GPU
that has it (marked ``gpu``).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from amped._internal.errors import value_error
from amped.lowp.float8.blockwise import BLOCK, BlockwiseTensor

__all__ = ["blockwise_mm", "has_blockwise_scaled_mm", "kernel_fits"]


@functools.cache
def _has_kernel(device: torch.device) -> bool:
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
        return False
    return torch.cuda.get_device_capability(device)[0] == 9


def has_blockwise_scaled_mm(device: torch.device) -> bool:
    """Whether ``device`` runs the blockwise FP8 GEMM in hardware (Hopper, compute
    capability 9.x, with ``torch.nn.functional.scaled_mm``); elsewhere it is emulated."""
    return _has_kernel(device)


def kernel_fits(a: BlockwiseTensor, b: BlockwiseTensor) -> bool:
    """Whether the kernel takes these operands: a left operand in 1x128 tiles, every dim a
    multiple of 128, on a device with the kernel (:func:`has_blockwise_scaled_mm`)."""
    dims = (*a.shape, b.shape[1])
    whole = a.tile == (1, BLOCK) and not any(d % BLOCK for d in dims)
    return whole and has_blockwise_scaled_mm(a.data.device)


def _check(a: BlockwiseTensor, b: BlockwiseTensor) -> None:
    if a.tile[1] != BLOCK or b.tile[0] != BLOCK or a.shape[1] != b.shape[0]:
        raise value_error(
            f"blockwise_mm multiplies [M, K] by [K, N] operands tiled {BLOCK} long along K "
            "(a: 1x128 or 128x128 tiles, b: 128x1 or 128x128)",
            "(a.shape, a.tile, b.shape, b.tile)",
            (tuple(a.shape), a.tile, tuple(b.shape), b.tile),
        )


def blockwise_mm(
    a: BlockwiseTensor, b: BlockwiseTensor, out_dtype: torch.dtype, *, emulate: bool = True
) -> torch.Tensor:
    """``dequantize(a) @ dequantize(b)`` rounded to ``out_dtype``, as a blockwise FP8 GEMM.

    Args:
        a: ``[M, K]``, tiles ``(1, 128)`` or ``(128, 128)``.
        b: ``[K, N]``, tiles ``(128, 1)`` or ``(128, 128)``.
        out_dtype: float32, bfloat16 or float16.
        emulate: run the exact float32 emulation (see the module); False calls the
            kernel, which needs :func:`has_blockwise_scaled_mm` and dims multiples of 128.

    Raises:
        ValueError: the operands' shapes or tiles do not fit.
    """
    _check(a, b)
    if not emulate:
        return _kernel(a, b, out_dtype)
    m, k = a.shape
    n = b.shape[1]
    # Scales per row of a and per column of b, one column/row per k-block.
    scale_a = a.scale_inv.repeat_interleave(a.tile[0], dim=0)[:m]
    scale_b = b.scale_inv.repeat_interleave(b.tile[1], dim=1)[:, :n]
    values_a = a.data.to(torch.float32)
    values_b = b.data.to(torch.float32)
    out = torch.zeros(m, n, dtype=torch.float32, device=a.data.device)
    for block, start in enumerate(range(0, k, BLOCK)):
        stop = min(start + BLOCK, k)
        partial = values_a[:, start:stop] @ values_b[start:stop]
        out += partial * (scale_a[:, block : block + 1] * scale_b[block : block + 1])
    return out.to(out_dtype)


def _kernel(a: BlockwiseTensor, b: BlockwiseTensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``torch.nn.functional.scaled_mm``'s blockwise path, with the layouts torchao's
    ``blockwise_fp8_training.linear`` passes (row-major ``a``, column-major ``b``; 1x128
    scales outer-dim-major; 128x128 scales K-major, the K-blocks padded to a multiple of 4)."""
    dims = (*a.shape, b.shape[1])
    if not kernel_fits(a, b):
        raise RuntimeError(
            "The blockwise FP8 kernel needs a Hopper GPU (compute capability 9.x) with "
            f"torch.nn.functional.scaled_mm, every dim a multiple of {BLOCK} and a left "
            "operand in 1x128 tiles; use emulate=True (exact). Received: "
            f"(M, K, N)={dims}, a.tile={a.tile} on {a.data.device}"
        )
    kinds = F.ScalingType
    data_a = a.data.contiguous()
    data_b = b.data.t().contiguous().t()
    scale_a = a.scale_inv.t().contiguous().t()
    kind_a = kinds.BlockWise1x128
    if b.tile == (BLOCK, BLOCK):
        kind_b, scale_b = kinds.BlockWise128x128, _k_major(b.scale_inv)
    else:  # 128x1 tiles of b are 1x128 tiles of its transpose: [N, K / 128]
        kind_b, scale_b = kinds.BlockWise1x128, b.scale_inv.contiguous().t()
    return F.scaled_mm(
        data_a,
        data_b,
        scale_a=scale_a,
        scale_recipe_a=kind_a,
        scale_b=scale_b,
        scale_recipe_b=kind_b,
        output_dtype=out_dtype,
    )


def _k_major(scale: torch.Tensor) -> torch.Tensor:
    """A ``[K / 128, N / 128]`` scale stored K-major with the K-blocks padded to a multiple
    of 4 (cuBLASLt's 128x128 layout: 16-byte aligned columns), as torchao pads it."""
    blocks = -(-scale.shape[0] // 4) * 4
    padded = scale.new_ones(scale.shape[1], blocks).t()
    padded[: scale.shape[0]] = scale
    return padded
