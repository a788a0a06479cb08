"""Block casts: a tensor to MX or NVFP4 elements with per-block scales, and back.

Each block of ``format.block_size`` consecutive elements along the last dim gets one
scale; the tensor is then divided by its block's scale, saturated to the element's
largest value and rounded (to nearest even; NVFP4 optionally stochastically).

**MX** (:func:`quantize_block` with an MX format) follows torchao 0.18's ``to_mx``
bit for bit, in all four scale modes of :mod:`amped.lowp.mx.block_format`. The stored scale
is an E8M0 exponent ``e`` (``float8_e8m0fnu``, value ``2 ** (e - 127)``). Two of
torchao's edge rules are kept so that results match: with ``floor``/``ceil``/``even``
a block whose scale would be ``2 ** -127`` divides by ``2 ** -126`` (the smallest
normal float32), and with ``rceil`` a block whose scale clamps to ``2 ** -127`` is not
divided at all. Either way its elements are far below anything that survives the cast.

**NVFP4** follows torchao's ``nvfp4_quantize`` with a per-tensor scale::

    tensor_scale = amax(x) / (448 * 6)                      float32
    block_scale  = e4m3(clamp(amax(block) / 6 / tensor_scale, 2**-6, 448))
    elements     = e2m1(clamp(x * ((1 / tensor_scale) / block_scale), -6, 6))
    x ~= elements * (tensor_scale * block_scale)

so a block's largest element lands on 6 and the largest block scale on 448. A tensor
whose amax is below 1e-30 (all zeros) takes the amax 1e-30, which keeps every scale
finite (torchao would divide by zero there). ``tile_2d=True`` takes one block scale
per 16x16 tile (the weight recipe of NVIDIA's NVFP4 training): the tile's scale is
stored on each of its 16 rows, so the layout is that of 1x16 blocks, and quantizing
``w.t()`` gives the transpose of quantizing ``w``.

**NaN and inf.** Finite inputs below ``2 ** 127`` never give inf or NaN: elements
saturate. (Above that, an element rounded up can read back past float32's range.) A NaN in an
MX block gives that block the E8M0 NaN scale (255), so the whole block reads back as
NaN (OCP MX spec, section 6.3). An inf in an MX block gives it the largest scale its
mode allows: the inf saturates to the element maximum, which reads back as inf again
(past float32's range), and the block's finite elements read back as 0. For NVFP4 a NaN or inf makes
the tensor scale NaN or inf, so the whole tensor reads back as NaN: loud, like the
per-tensor FP8 casts.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from amped._internal.errors import type_error, value_error
from amped.lowp.mx.block_format import SCALE_MODES, BlockFormat, ScaleMode
from amped.lowp.mx.block_kernel import NVFP4_AMAX_FLOOR, BlockSpec, block_kernel, nvfp4_tensor_scale
from amped.lowp.mx.e2m1 import pack_e2m1, to_e2m1_codes
from amped.lowp.mx.element_round import ELEMENTS, rounding_key

__all__ = [
    "NVFP4_AMAX_FLOOR",
    "BlockTensor",
    "block_spec",
    "check_block_input",
    "check_block_multiple",
    "nvfp4_tensor_scale",
    "quantize_block",
]


class BlockTensor(NamedTuple):
    """A tensor in a block format.

    Attributes:
        elements: the element values, exactly, in the cast's compute dtype (bfloat16
            for an MX cast of bfloat16 input, else float32), ``x``'s shape.
        scale_bits: one scale per block, ``[..., K // block_size]``, its bits in uint8
            (:attr:`scale` is the same in the format's scale dtype; torch.compile
            handles uint8 where it cannot yet handle ``float8_e8m0fnu``).
        tensor_scale: NVFP4's float32 tensor scale (None for MX).
        format: the :class:`~amped.lowp.mx.block_format.BlockFormat`.
    """

    elements: torch.Tensor
    scale_bits: torch.Tensor
    tensor_scale: torch.Tensor | None
    format: BlockFormat

    @property
    def scale(self) -> torch.Tensor:
        """The block scales in ``float8_e8m0fnu`` (MX) or ``float8_e4m3fn`` (NVFP4)."""
        return self.scale_bits.view(self.format.scale_dtype)

    @property
    def data(self) -> torch.Tensor:
        """The stored elements: FP8, or E2M1 packed two per byte (``float4_e2m1fn_x2``)."""
        if self.format.is_fp4:
            return pack_e2m1(to_e2m1_codes(self.elements))
        return self.elements.to(self.format.elem_dtype)

    def block_scale(self) -> torch.Tensor:
        """The block scales in float32 (E8M0 255 reads as NaN), without the tensor scale."""
        if self.format.is_mx:
            exponent = self.scale_bits
            value = torch.exp2(exponent.to(torch.float32) - 127)
            return torch.where(exponent == 255, float("nan"), value)
        return self.scale_bits.view(torch.float8_e4m3fn).to(torch.float32)

    def block_values(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``elements * block scale`` in ``dtype``, without the tensor scale.

        Exact in float32 and bfloat16: an FP8 element times a power of two, or an E2M1
        element (2 significant bits) times an E4M3 scale (4 bits), has at most 6
        significant bits (unless it underflows below the dtype's normal range).
        """
        blocks = self.elements.unflatten(-1, (-1, self.format.block_size))
        scale = self.block_scale().unsqueeze(-1).to(blocks.dtype)  # exact: see above
        return (blocks * scale).flatten(-2).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor read back in ``dtype``, rounded as torchao's ``dequantize`` rounds."""
        blocks = self.elements.unflatten(-1, (-1, self.format.block_size))
        if self.format.is_mx:  # torchao: elements and scale in dtype, one exact product
            scale = self.block_scale().to(dtype).unsqueeze(-1)
            return (blocks.to(dtype) * scale).flatten(-2)
        scale = self.block_scale()
        if self.tensor_scale is not None:
            scale = self.tensor_scale * scale
        return (blocks.to(torch.float32) * scale.unsqueeze(-1)).flatten(-2).to(dtype)


def check_block_multiple(fmt: BlockFormat, name: str, shape: tuple[int, ...]) -> None:
    """Refuse a blocked dim (the last of ``shape``) that is not a multiple of the block."""
    if not shape or shape[-1] % fmt.block_size:
        raise value_error(
            f"{fmt} scales blocks of {fmt.block_size} elements along the last dim, which "
            "must be a multiple of that; pad the tensor or keep this layer out of block "
            "formats (module_filter)",
            name,
            shape,
        )


def check_block_input(x: torch.Tensor, fmt: BlockFormat, tile_2d: bool) -> None:
    """Refuse a tensor, format or tiling a block cast cannot take (see quantize_block)."""
    if not isinstance(fmt, BlockFormat):
        raise type_error(
            "format is a BlockFormat (see amped.lowp.mx.block_format.BLOCK_FORMATS)", "format", fmt
        )
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise type_error(
            "Block casts take float32, bfloat16 or float16 tensors; convert it first",
            "x.dtype",
            x.dtype,
        )
    check_block_multiple(fmt, "x.shape", tuple(x.shape))
    if tile_2d and (fmt.is_mx or x.dim() != 2 or x.shape[0] % 16):
        raise value_error(
            "16x16 tiles are for NVFP4 2-D tensors whose both dims are multiples of 16",
            "x.shape",
            (fmt.name, tuple(x.shape)),
        )


@torch.no_grad()
def quantize_block(
    x: torch.Tensor,
    format: BlockFormat,
    scale_mode: ScaleMode = "rceil",
    *,
    tensor_scale: torch.Tensor | None = None,
    tile_2d: bool = False,
    generator: torch.Generator | None = None,
) -> BlockTensor:
    """Quantize ``x`` to ``format``, blocks along its last dim.

    Args:
        x: float32, bfloat16 or float16, any number of leading dims; the last dim a
            multiple of the block size.
        format: an entry of :data:`amped.lowp.mx.block_format.BLOCK_FORMATS`.
        scale_mode: MX only: how block scales round (see :mod:`.block_format`).
        tensor_scale: NVFP4 only: the float32 tensor scale (default
            :func:`nvfp4_tensor_scale` of ``x``).
        tile_2d: NVFP4 only: one block scale per 16x16 tile of a 2-D ``x``.
        generator: E2M1 only: round elements stochastically, with draws hashed from
            a key drawn from it (:func:`~amped.lowp.mx.element_round.hashed_uniform`).

    Raises:
        TypeError: ``x`` not floating point, or ``format`` not a BlockFormat.
        ValueError: the last dim is not a multiple of the block size, or an option
            that does not apply to ``format``.

    Example:
        >>> import torch
        >>> from amped.lowp import BLOCK_FORMATS
        >>> q = quantize_block(torch.linspace(-1, 1, 32), BLOCK_FORMATS["mxfp8"])
        >>> q.scale.view(torch.uint8), q.dequantize()[-1]
        (tensor([119], dtype=torch.uint8), tensor(1.))
    """
    check_block_input(x, format, tile_2d)
    if scale_mode not in SCALE_MODES:
        raise value_error(f"scale_mode is one of {SCALE_MODES}", "scale_mode", scale_mode)
    if generator is not None and not format.is_fp4:
        raise value_error("Stochastic rounding is for E2M1 formats", "format", format.name)
    if format.is_mx and tensor_scale is not None:
        raise value_error("MX formats have no tensor scale", "tensor_scale", tensor_scale)
    # MX elements of bfloat16 input are returned in bfloat16 (exact), as before.
    elements_dtype = torch.bfloat16 if format.is_mx and x.dtype is torch.bfloat16 else None
    spec = block_spec(format, scale_mode, -1, tile_2d, elements_dtype or torch.float32, None)
    spec = spec._replace(
        given_tensor_scale=tensor_scale is not None, stochastic=generator is not None
    )
    key = None if generator is None else rounding_key(generator, x.device)
    _, elements, scale_bits, tensor_scale, _ = block_kernel(spec, x, tensor_scale, key)
    assert elements is not None and scale_bits is not None  # the spec asks for them
    return BlockTensor(elements, scale_bits, tensor_scale, format)


def block_spec(
    fmt: BlockFormat,
    scale_mode: ScaleMode,
    blocked_dim: int,
    tile_2d: bool,
    elements_dtype: torch.dtype | None,
    values_dtype: torch.dtype | None,
) -> BlockSpec:
    """The :class:`~amped.lowp.mx.block_kernel.BlockSpec` of a cast (nearest rounding, the
    tensor scale computed; ``_replace`` the last two fields to change that)."""
    emax = fmt.elem_emax if fmt.is_mx else 0
    element = ELEMENTS[fmt.elem_dtype]
    return BlockSpec(
        fmt.block_size,
        fmt.is_mx,
        element,
        emax,
        scale_mode,
        blocked_dim,
        tile_2d,
        elements_dtype,
        values_dtype,
        False,
        False,
    )
