"""The operand of an emulated block GEMM, made by one compiled kernel per tensor.

An emulated block GEMM multiplies *block values*, ``elements * block scale``, which are
exact in bfloat16 (and float32): see
:meth:`~amped.lowp.mx.block_cast.BlockTensor.block_values`. :func:`block_operand` makes
them straight from the high-precision tensor in one pass (amax, scale, saturation,
rounding and the product with the block scale fused by
:func:`amped.lowp.float8.compiled_cast.run`), instead of a cast that stores the elements and a
second pass that multiplies them back. The values are the same bits as
``quantize_block(x).block_values(dtype)`` (tests/lowp/mx/test_fp8_compiled_cast.py).

Blocks run along the last dim (``dim=-1``) or the first dim of a 2-D tensor
(``dim=0``): the operand of ``x.t()``, laid out as ``x``, so the transposed operands of
the backward GEMMs need no ``.contiguous()`` copy; :meth:`BlockOperand.t` gives the
transposed view.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from amped._internal.errors import value_error
from amped.lowp.float8 import compiled_cast
from amped.lowp.mx.block_cast import BlockTensor, block_spec, check_block_input
from amped.lowp.mx.block_format import BlockFormat, ScaleMode
from amped.lowp.mx.block_kernel import block_kernel
from amped.lowp.mx.element_round import rounding_key
from amped.lowp.mx.hadamard import HADAMARD_SIZE

__all__ = ["BlockOperand", "block_operand"]


class BlockOperand(NamedTuple):
    """A GEMM operand in a block format, as its exact block values.

    Attributes:
        values: ``elements * block scale`` in the GEMM's dtype, the input's shape
            (None when not asked for: a hardware GEMM takes the cast).
        tensor_scale: NVFP4's float32 tensor scale (None for MX), applied to the
            GEMM's result.
        cast: the :class:`~amped.lowp.mx.block_cast.BlockTensor` (elements and scales)
            when asked for (``keep_cast=True``: the health monitor reads it), else None.
    """

    values: torch.Tensor | None
    tensor_scale: torch.Tensor | None
    cast: BlockTensor | None

    def t(self) -> BlockOperand:
        """The transpose of a 2-D operand (values and cast transposed together)."""
        cast = self.cast
        if cast is not None:
            cast = cast._replace(elements=cast.elements.t(), scale_bits=cast.scale_bits.t())
        values = None if self.values is None else self.values.t()
        return BlockOperand(values, self.tensor_scale, cast)


@torch.no_grad()
def block_operand(
    x: torch.Tensor,
    format: BlockFormat,
    scale_mode: ScaleMode = "rceil",
    *,
    dim: int = -1,
    tile_2d: bool = False,
    dtype: torch.dtype | None = torch.bfloat16,
    generator: torch.Generator | None = None,
    keep_cast: bool = False,
    hadamard_signs: torch.Tensor | None = None,
) -> BlockOperand:
    """``x`` cast to ``format`` and read back as exact block values in ``dtype``.

    Args:
        x: float32, bfloat16 or float16; 2-D for ``dim=0`` and ``tile_2d``.
        format, scale_mode: as :func:`~amped.lowp.mx.block_cast.quantize_block`.
        dim: the blocked dim: -1 (the last) or 0 (the first, of a 2-D ``x``).
        tile_2d: NVFP4: one scale per 16x16 tile (then ``dim`` makes no difference).
        dtype: the values' dtype, bfloat16 or float32; None for none (then
            ``keep_cast`` must be set).
        generator: E2M1: round stochastically, with the draws
            :func:`~amped.lowp.mx.element_round.hashed_uniform` of a key drawn from it
            (element ``i`` of ``x``, row-major, gets draw ``i``).
        keep_cast: also return the elements and scales (``.cast``), in ``x``'s layout:
            for ``dim=0`` one scale per block of rows (``[M // block, N]``), so that
            the operand's :meth:`~BlockOperand.t` holds the cast of ``x.t()`` as
            :func:`~amped.lowp.mx.block_cast.quantize_block` gives it (blocks along the
            last dim), which the GEMM and the health monitor read.
        hadamard_signs: with ``dim=0``: cast ``R.T @ x`` instead of ``x``, ``R`` the
            random Hadamard transform with these 16 signs (float32,
            :func:`~amped.lowp.mx.hadamard.hadamard_rows`), rotated inside the cast kernel.

    Raises:
        ValueError: the blocked dim is not a multiple of the block size (16 rows
            for ``hadamard_signs``).
    """
    if dim == 0 and x.dim() == 2:
        check_block_input(x.t(), format, tile_2d)
    else:
        check_block_input(x, format, tile_2d)
        dim = -1
    if hadamard_signs is not None and (dim != 0 or x.shape[0] % HADAMARD_SIZE):
        raise value_error(
            f"The Hadamard transform rotates blocks of {HADAMARD_SIZE} rows of a 2-D "
            "tensor cast with dim=0; pad the rows to a multiple of that",
            "x.shape",
            tuple(x.shape),
        )
    elements_dtype = None
    if keep_cast:  # the dtype quantize_block returns them in
        bf16_mx = format.is_mx and x.dtype is torch.bfloat16
        elements_dtype = torch.bfloat16 if bf16_mx else torch.float32
    spec = block_spec(format, scale_mode, dim, tile_2d, elements_dtype, dtype)
    spec = spec._replace(stochastic=generator is not None, hadamard=hadamard_signs is not None)
    key = None if generator is None else rounding_key(generator, x.device)
    values, elements, scale_bits, tensor_scale, _ = compiled_cast.run(
        block_kernel, spec, x, None, key, hadamard_signs
    )
    cast = None
    if elements is not None:
        assert scale_bits is not None  # returned with the elements
        if tile_2d and dim == 0:  # a tile's scale, per block of rows: [M // 16, N]
            size = format.block_size
            scale_bits = scale_bits[::size].repeat_interleave(size, dim=1)
        cast = BlockTensor(elements, scale_bits, tensor_scale, format)
    return BlockOperand(values, tensor_scale, cast)
