"""Block casts: a tensor to MX or NVFP4 elements with per-block scales, and back.

Each block of ``format.block_size`` consecutive elements along the last dim gets one
scale; the tensor is then divided by its block's scale, saturated to the element's
largest value and rounded (to nearest even; NVFP4 optionally stochastically).

**MX** (:func:`quantize_block` with an MX format) follows torchao 0.18's ``to_mx``
bit for bit, in all four scale modes of :mod:`amped.fp8.block_format`. The stored scale
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
from amped.fp8.block_format import SCALE_MODES, BlockFormat, ScaleMode
from amped.fp8.e2m1 import pack_e2m1, to_e2m1_codes
from amped.fp8.element_round import ELEMENTS, round_nearest_, round_stochastic_

__all__ = [
    "NVFP4_AMAX_FLOOR",
    "BlockTensor",
    "check_block_multiple",
    "nvfp4_tensor_scale",
    "quantize_block",
]

NVFP4_AMAX_FLOOR = 1e-30
"""Smallest tensor amax an NVFP4 tensor scale is computed from."""
_E4M3_TINY = 2.0**-6  # torchao's E4M3_EPS: smallest normal e4m3, the floor of a block scale
_F32_MIN_NORMAL = 2.0**-126


class BlockTensor(NamedTuple):
    """A tensor in a block format.

    Attributes:
        elements: the element values, exactly, in the cast's compute dtype (bfloat16
            for an MX cast of bfloat16 input, else float32), ``x``'s shape.
        scale_bits: one scale per block, ``[..., K // block_size]``, its bits in uint8
            (:attr:`scale` is the same in the format's scale dtype; torch.compile
            handles uint8 where it cannot yet handle ``float8_e8m0fnu``).
        tensor_scale: NVFP4's float32 tensor scale (None for MX).
        format: the :class:`~amped.fp8.block_format.BlockFormat`.
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


def nvfp4_tensor_scale(x: torch.Tensor) -> torch.Tensor:
    """NVFP4's float32 tensor scale of ``x``: ``max(amax, 1e-30) / (448 * 6)``."""
    amax = x.abs().amax().to(torch.float32)
    return amax.clamp(min=NVFP4_AMAX_FLOOR) / (448.0 * 6.0)


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


def _check(x: torch.Tensor, fmt: BlockFormat, tile_2d: bool) -> None:
    if not isinstance(fmt, BlockFormat):
        raise type_error(
            "format is a BlockFormat (see amped.fp8.block_format.BLOCK_FORMATS)", "format", fmt
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


def _mx_exponent(amax: torch.Tensor, fmt: BlockFormat, mode: ScaleMode) -> torch.Tensor:
    """The biased E8M0 exponent (int32, 0..255) of each block's scale (torchao's rules)."""
    if mode == "rceil":
        descale = amax / fmt.elem_max
        exponent = torch.ceil(torch.log2(descale)).clamp(-127, 127) + 127
        exponent = torch.where(torch.isinf(descale), 254, exponent)
        return torch.where(torch.isnan(descale), 255, exponent).to(torch.int32)
    bits = amax.view(torch.int32)
    if mode == "even":  # round the amax to the element's mantissa width first
        half_ulp = 1 << (23 - fmt.elem_mbits - 1)
        bits = (bits + half_ulp) & -(1 << 23)  # keep sign and exponent: 0xFF800000
    unbiased = ((bits >> 23) & 0xFF) - 127
    if mode == "ceil":
        unbiased = unbiased + ((bits & 0x7FFFFF) > 0).to(torch.int32)
    exponent = (unbiased - fmt.elem_emax).clamp(-127, 128) + 127
    return torch.where(torch.isnan(amax), 255, exponent)


def _mx_reciprocal(exponent: torch.Tensor, mode: ScaleMode) -> torch.Tensor:
    """What each block is multiplied by before the cast (``1 / scale``, torchao's edges)."""
    if mode == "rceil":
        value = torch.exp2(127 - exponent.to(torch.float32))
        value = torch.where(exponent == 0, 1.0, value)
        value = torch.where(exponent == 254, 2.0**-127, value)
        return torch.where(exponent == 255, float("nan"), value)
    scale = (exponent << 23).view(torch.float32).clamp(min=_F32_MIN_NORMAL)
    return scale.reciprocal()  # exact: a power of two (inf for exponent 255: 1/inf = 0)


def _block_amax(blocks: torch.Tensor) -> torch.Tensor:
    """Largest magnitude of each block (the last dim), kept as size 1; NaN if any.

    bfloat16 takes the maximum of the bits with the sign cleared: for non-negative
    floats the integer order is the float order (NaN above inf), and torch's CPU
    integer reduction is several times faster than its bfloat16 one.
    """
    if blocks.dtype is torch.bfloat16:
        bits = blocks.view(torch.int16) & 0x7FFF
        return bits.amax(dim=-1, keepdim=True).view(torch.bfloat16)
    return blocks.abs().amax(dim=-1, keepdim=True)


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
        format: an entry of :data:`amped.fp8.block_format.BLOCK_FORMATS`.
        scale_mode: MX only: how block scales round (see :mod:`.block_format`).
        tensor_scale: NVFP4 only: the float32 tensor scale (default
            :func:`nvfp4_tensor_scale` of ``x``).
        tile_2d: NVFP4 only: one block scale per 16x16 tile of a 2-D ``x``.
        generator: E2M1 only: round elements stochastically, drawing from it.

    Raises:
        TypeError: ``x`` not floating point, or ``format`` not a BlockFormat.
        ValueError: the last dim is not a multiple of the block size, or an option
            that does not apply to ``format``.

    Example:
        >>> import torch
        >>> from amped.fp8 import BLOCK_FORMATS
        >>> q = quantize_block(torch.linspace(-1, 1, 32), BLOCK_FORMATS["mxfp8"])
        >>> q.scale.view(torch.uint8), q.dequantize()[-1]
        (tensor([119], dtype=torch.uint8), tensor(1.))
    """
    _check(x, format, tile_2d)
    if scale_mode not in SCALE_MODES:
        raise value_error(f"scale_mode is one of {SCALE_MODES}", "scale_mode", scale_mode)
    if generator is not None and not format.is_fp4:
        raise value_error("Stochastic rounding is for E2M1 formats", "format", format.name)
    # MX scales are powers of two: scaling a bfloat16 x is exact in bfloat16, so it stays
    # there (half the bytes per pass). NVFP4's are not: float32, as torchao computes.
    compute = torch.bfloat16 if format.is_mx and x.dtype is torch.bfloat16 else torch.float32
    xc = x.to(compute)
    blocks = xc.unflatten(-1, (-1, format.block_size))
    if tile_2d:  # one amax per 16x16 tile, repeated on the tile's rows: [M, K/16, 1]
        tiles = xc.unflatten(0, (-1, 16)).unflatten(-1, (-1, 16))  # [M/16, 16, K/16, 16]
        amax = tiles.abs().amax(dim=(1, 3)).repeat_interleave(16, dim=0).unsqueeze(-1)
    else:
        amax = _block_amax(blocks)
    amax = amax.to(torch.float32)
    if format.is_mx:
        if tensor_scale is not None:
            raise value_error("MX formats have no tensor scale", "tensor_scale", tensor_scale)
        exponent = _mx_exponent(amax, format, scale_mode)
        scaled = blocks * _mx_reciprocal(exponent, scale_mode).to(compute)
        scale_bits = exponent.to(torch.uint8)
    else:
        if tensor_scale is None:
            tensor_scale = nvfp4_tensor_scale(xc)
        ratio = amax / 6.0 / tensor_scale
        scale = ratio.clamp(_E4M3_TINY, 448.0).to(torch.float8_e4m3fn)
        scaled = blocks * ((1.0 / tensor_scale) / scale.to(torch.float32))
        scale_bits = scale.view(torch.uint8)
    element = ELEMENTS[format.elem_dtype]
    if generator is not None:
        elements = round_stochastic_(scaled, element, generator)
    else:
        elements = round_nearest_(scaled, element)
    return BlockTensor(elements.flatten(-2), scale_bits.squeeze(-1), tensor_scale, format)
