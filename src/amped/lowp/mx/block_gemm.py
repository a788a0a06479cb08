"""The block-scaled GEMM: exact emulation on any device, ``torch._scaled_mm`` on sm100.

``block_mm(a, b)`` computes ``a @ b.T`` for ``a`` ``[M, K]`` and ``b`` ``[N, K]``, both
blocked along K (how every block GEMM kernel takes its operands).

**Emulation.** Each operand becomes its block values, ``elements * block_scale``, in the
GEMM's dtype: exact there (at most 6 significant bits, see
:meth:`~amped.lowp.mx.block_cast.BlockTensor.block_values`), so every product of two
operands is exact and a bfloat16 GEMM, which accumulates in float32 (AMX and AVX512-BF16
on CPUs), is the fast route under bfloat16 autocast where the device multiplies bfloat16
natively; where it does not (an AVX2 CPU), a float32 GEMM of float32 block values is
(:mod:`amped.lowp.float8.emulated_gemm`); a float32 output takes a float32 GEMM. NVFP4's
two tensor scales multiply the float32 accumulator, as the hardware kernel does: on a
CPU as the GEMM's ``alpha`` (``addmm``, which costs what ``mm`` costs), elsewhere (and
inside a user's ``torch.compile``, where ``alpha``'s Python number would break the
graph) by a float32 GEMM result times the scale; either way the result is rounded to the
output dtype once. So against the float64 product of the dequantized operands the
emulation differs only by float32 summation order and that one rounding
(tests/lowp/mx/test_block_linear.py holds bfloat16 results to the float64 product rounded once).

**Native.** On a GPU with block-scaled tensor cores (compute capability 10.x,
Blackwell), ``torch._scaled_mm`` takes the stored elements and scales in cuBLAS's
swizzled layout (:func:`swizzle_scales`). Untested on hardware in this repository's CI;
``benchmarks/gpu_check.sh`` runs it where a GPU is lent.
"""

from __future__ import annotations

import functools

import torch

from amped._internal import torch_compat
from amped.lowp.float8.gemm import gemm_dtype
from amped.lowp.mx.block_cast import BlockTensor
from amped.lowp.mx.block_operand import BlockOperand

__all__ = [
    "block_mm",
    "has_block_scaled_mm",
    "operand_mm",
    "swizzle_scales",
]


@functools.cache
def has_block_scaled_mm(device: torch.device) -> bool:
    """Whether ``device`` runs MX/NVFP4 GEMMs in hardware: CUDA compute capability 10.x."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_capability(device)[0] == 10
    return False


def require_block_scaled_mm(device: torch.device) -> None:
    """Refuse a forced native block GEMM on a device without one."""
    if not has_block_scaled_mm(device):
        raise RuntimeError(
            f"Block-scaled GEMMs (MXFP8, MXFP4, NVFP4) run natively on sm100-class GPUs "
            f"(compute capability 10.x) only; {device} has none. Leave emulate=None (the "
            "exact emulation where there is no such GPU) or pass emulate=True."
        )


def swizzle_scales(scale: torch.Tensor) -> torch.Tensor:
    """A ``[rows, K // block]`` scale matrix in cuBLAS's 128x4 block layout, flattened.

    Padded with zeros to multiples of 128 rows and 4 columns; each 128x4 tile is stored
    as 32 rows of 16 (cuBLAS "block scaling factors layout").
    """
    rows, cols = scale.shape
    padded = scale.new_zeros(-(-rows // 128) * 128, -(-cols // 4) * 4)
    padded[:rows, :cols] = scale
    tiles = padded.view(-1, 128, padded.shape[1] // 4, 4).permute(0, 2, 1, 3)
    return tiles.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16).flatten()


def _native(a: BlockTensor, b: BlockTensor, out_dtype: torch.dtype) -> torch.Tensor:
    require_block_scaled_mm(a.elements.device)
    scale_a = swizzle_scales(a.scale.view(torch.uint8)).view(a.scale.dtype)
    scale_b = swizzle_scales(b.scale.view(torch.uint8)).view(b.scale.dtype)
    out = torch_compat.scaled_mm(
        a.data.contiguous(), b.data.contiguous().t(), scale_a, scale_b, torch.bfloat16, False
    )
    if a.tensor_scale is None or b.tensor_scale is None:
        return out.to(out_dtype)
    return (out.to(torch.float32) * (a.tensor_scale * b.tensor_scale)).to(out_dtype)


def block_mm(
    a: BlockTensor, b: BlockTensor, out_dtype: torch.dtype, *, emulate: bool = True
) -> torch.Tensor:
    """``dequantize(a) @ dequantize(b).T`` as a block-scaled GEMM, in ``out_dtype``.

    Args:
        a: ``[M, K]`` block tensor (blocks along K).
        b: ``[N, K]`` block tensor of the same format.
        out_dtype: bfloat16, float16 or float32.
        emulate: the exact emulation (any device) or the hardware GEMM (sm100 GPUs;
            RuntimeError elsewhere).
    """
    if emulate:
        dtype = gemm_dtype(out_dtype, a.elements.device)
        values_a, values_b = a.block_values(dtype), b.block_values(dtype)
        return _emulated(values_a, values_b, a.tensor_scale, b.tensor_scale, out_dtype)
    return _native(a, b, out_dtype)


def operand_mm(
    a: BlockOperand, b: BlockOperand, out_dtype: torch.dtype, *, emulate: bool = True
) -> torch.Tensor:
    """``a @ b.T`` of two block operands (``[M, K]`` and ``[N, K]``, blocked along K, any
    layout) in ``out_dtype``: :func:`block_mm` (the same bits), the emulation from the
    block values :func:`~amped.lowp.mx.block_operand.block_operand` made in
    :func:`~amped.lowp.float8.gemm.gemm_dtype`, the hardware GEMM from their casts."""
    if emulate:
        if a.values is None or b.values is None:
            raise ValueError("An emulated block GEMM needs the operands' block values")
        return _emulated(a.values, b.values, a.tensor_scale, b.tensor_scale, out_dtype)
    if a.cast is None or b.cast is None:
        raise ValueError("A native block GEMM needs the operands' elements and scales")
    return _native(a.cast, b.cast, out_dtype)


def _emulated(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor | None,
    scale_b: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``a @ b.T`` of exact block values, times NVFP4's tensor scales where both have
    one, rounded to ``out_dtype`` once (see the module)."""
    if scale_a is None or scale_b is None:
        return (a @ b.t()).to(out_dtype)
    scale = scale_a * scale_b  # float32: one rounding, as the hardware kernel's
    # float() of a CPU tensor syncs nothing; inside a user's torch.compile it would
    # break the graph (Dynamo cannot trace a Python number out of a tensor)
    if a.device.type == "cpu" and not torch.compiler.is_compiling():
        # oneDNN multiplies the float32 accumulator by alpha, then rounds once
        empty = a.new_empty(())  # beta=0: never read (not even its NaNs)
        return torch.addmm(empty, a, b.t(), beta=0, alpha=float(scale)).to(out_dtype)
    product = a.to(torch.float32) @ b.to(torch.float32).t()  # exact operands
    return (product * scale).to(out_dtype)
