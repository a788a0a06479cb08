"""The arithmetic of a block cast: one pure function, run eagerly or compiled.

:func:`block_kernel` computes, for one tensor, each block's amax and scale, the
elements (saturated and rounded), and optionally the *block values*
``elements * block scale`` in bfloat16 or float32, the exact operand of the emulated
GEMM (:mod:`.block_operand`). :func:`amped.lowp.mx.block_cast.quantize_block` calls it
eagerly; the layers call it through :func:`amped.lowp.float8.compiled_cast.run`, where it is
one fused kernel. Both give the same bits (tests/lowp/mx/test_fp8_compiled_cast.py): all
arithmetic is float32 (scaling by a power of two is exact there, as in bfloat16, and
the elements, exact in bfloat16, are converted last), each step rounds once, and
random draws are an integer hash of a key that comes in as an argument.

Blocks run along the last dim, or along the first of a 2-D tensor (``blocked_dim=0``:
the blocks of ``x.t()``, computed and laid out in ``x``'s own layout, so a transposed
GEMM operand needs no ``.contiguous()`` copy), or over 16x16 tiles (``tile_2d``).
With ``hadamard`` the rows are first rotated by NVFP4's random Hadamard transform
(:func:`amped.lowp.mx.hadamard.hadamard_rows`) in float32, inside the same kernel.
The scale rules are :mod:`amped.lowp.mx.block_cast`'s (torchao's), documented there.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from amped.lowp.mx.element_round import Element, hashed_uniform, round_nearest, round_stochastic
from amped.lowp.mx.hadamard import hadamard_rows

__all__ = [
    "NVFP4_AMAX_FLOOR",
    "BlockKernelOutput",
    "BlockSpec",
    "block_kernel",
    "nvfp4_tensor_scale",
]

NVFP4_AMAX_FLOOR = 1e-30
"""Smallest tensor amax an NVFP4 tensor scale is computed from."""
_E4M3_TINY = 2.0**-6  # torchao's E4M3_EPS: smallest normal e4m3, the floor of a block scale
_F32_MIN_NORMAL = 2.0**-126
TILE = 16  # NVFP4's 2-D weight tiles are TILE x TILE


class BlockSpec(NamedTuple):
    """The static settings of one block cast (a compiled kernel each)."""

    block_size: int
    is_mx: bool
    element: Element
    elem_emax: int  # MX: the exponent of the element's largest power of two
    scale_mode: str
    blocked_dim: int  # -1: blocks along the last dim; 0: along the first (2-D)
    tile_2d: bool
    elements_dtype: torch.dtype | None  # the elements returned in it (None: not returned)
    values_dtype: torch.dtype | None  # the block values returned in it (None: not made)
    given_tensor_scale: bool
    stochastic: bool
    hadamard: bool = False  # rotate blocks of 16 rows first (blocked_dim 0; signs given)


def nvfp4_tensor_scale(x: torch.Tensor) -> torch.Tensor:
    """NVFP4's float32 tensor scale of ``x``: ``max(amax, 1e-30) / (448 * 6)``."""
    amax = x.abs().amax().to(torch.float32)
    return _one_nan(amax.clamp(min=NVFP4_AMAX_FLOOR) / (448.0 * 6.0))


def _one_nan(x: torch.Tensor) -> torch.Tensor:
    """NaNs made the one positive NaN: eager and compiled code (and x86 arithmetic)
    keep a NaN's sign and payload differently. ``!=``, not isnan: Inductor vectorizes
    the comparison."""
    return torch.where(x != x, float("nan"), x)


def mx_exponent(amax: torch.Tensor, element: Element, emax: int, mode: str) -> torch.Tensor:
    """The biased E8M0 exponent (int32, 0..255) of each block's scale (torchao's rules)."""
    if mode == "rceil":
        descale = amax / element.max
        exponent = torch.ceil(torch.log2(descale)).clamp(-127, 127) + 127
        exponent = torch.where(descale == float("inf"), 254, exponent)  # descale >= 0
        return torch.where(descale != descale, 255, exponent).to(torch.int32)
    bits = amax.view(torch.int32)
    if mode == "even":  # round the amax to the element's mantissa width first
        half_ulp = 1 << (23 - element.mbits - 1)
        bits = (bits + half_ulp) & -(1 << 23)  # keep sign and exponent: 0xFF800000
    unbiased = ((bits >> 23) & 0xFF) - 127
    if mode == "ceil":
        unbiased = unbiased + ((bits & 0x7FFFFF) > 0).to(torch.int32)
    exponent = (unbiased - emax).clamp(-127, 128) + 127
    return torch.where(amax != amax, 255, exponent)


def _mx_reciprocal(exponent: torch.Tensor, mode: str) -> torch.Tensor:
    """What each block is multiplied by before the cast (``1 / scale``, torchao's edges)."""
    if mode == "rceil":
        value = torch.exp2(127 - exponent.to(torch.float32))
        value = torch.where(exponent == 0, 1.0, value)
        value = torch.where(exponent == 254, 2.0**-127, value)
        return torch.where(exponent == 255, float("nan"), value)
    scale = torch.exp2(exponent.to(torch.float32) - 127).clamp(min=_F32_MIN_NORMAL)
    return scale.reciprocal()  # exact: a power of two (inf for exponent 255: 1/inf = 0)


def e8m0_value(exponent: torch.Tensor) -> torch.Tensor:
    """``2 ** (exponent - 127)`` in float32 (255: NaN), as
    :meth:`~amped.lowp.mx.block_cast.BlockTensor.block_scale` reads it.

    ``exp2`` of an integer is exact, eager and compiled (SLEEF's, both); the exponent
    bits shifted into a float32 would be too, but Inductor's CPU code moves each element
    through memory for that bit cast, which is slow where the scale varies along the
    vectorized dim (blocks along dim 0).
    """
    value = torch.exp2(exponent.to(torch.float32) - 127)
    return torch.where(exponent == 255, float("nan"), value)


def _blocked(x: torch.Tensor, spec: BlockSpec) -> tuple[torch.Tensor, tuple[int, ...]]:
    """A view of ``x`` with each block on axes of its own, and those axes."""
    if spec.tile_2d:
        return x.unflatten(0, (-1, TILE)).unflatten(-1, (-1, TILE)), (1, 3)
    if spec.blocked_dim == 0:
        return x.unflatten(0, (-1, spec.block_size)), (1,)
    return x.unflatten(-1, (-1, spec.block_size)), (-1,)


def _scale_layout(scale: torch.Tensor, spec: BlockSpec, shape: torch.Size) -> torch.Tensor:
    """Per-block scales (size 1 on the block axes) as ``[..., K / block]`` (last dim
    blocked; tiles repeated on their 16 rows) or ``[M / block, K]`` (first dim)."""
    if spec.tile_2d:
        tiles = scale.expand(-1, TILE, -1, 1)
        return tiles.reshape(shape[0], shape[1] // TILE)
    return scale.squeeze(1 if spec.blocked_dim == 0 else -1)


def _block_amax(
    blocks: torch.Tensor, axes: tuple[int, ...], spec: BlockSpec, fold: bool
) -> torch.Tensor:
    """Each block's largest magnitude (NaN where the block holds one), size 1 on ``axes``.

    With ``fold`` (set for 16-bit inputs), blocks of 32 along the last dim are folded in
    halves first (an elementwise maximum of two contiguous half-blocks): Inductor's CPU
    code reduces each block across the lanes of its vectors, and a half-block of 16 is
    one float32 vector, one fewer to reduce (about a tenth less time for a 2048 x 2048
    bfloat16 MX cast). Not for float32 input, which Inductor already reduces in halves,
    nor NVFP4's blocks of 16 (no gain measured). ``max`` is exact in any order: the same
    amax either way.
    """
    magnitude = blocks.abs()
    if not fold or spec.block_size != 32 or spec.blocked_dim == 0:  # (tiles: NVFP4, 16)
        return magnitude.amax(dim=axes, keepdim=True)
    folded = torch.maximum(magnitude[..., :16], magnitude[..., 16:])
    return folded.amax(dim=-1, keepdim=True)


class BlockKernelOutput(NamedTuple):
    """What :func:`block_kernel` returns (see there)."""

    values: torch.Tensor | None
    elements: torch.Tensor | None
    scale_bits: torch.Tensor | None  # with the elements only
    tensor_scale: torch.Tensor | None
    block_factors: tuple[torch.Tensor, torch.Tensor]


def block_kernel(
    spec: BlockSpec,
    x: torch.Tensor,
    tensor_scale: torch.Tensor | None,
    key: torch.Tensor | None,
    signs: torch.Tensor | None = None,
) -> BlockKernelOutput:
    """``(values, elements, scale_bits, tensor_scale, block_factors)`` of ``x`` cast by
    ``spec``.

    ``values`` and ``elements`` have ``x``'s shape and layout (None where ``spec`` does
    not ask for them); ``scale_bits`` (uint8) one per block (:func:`_scale_layout`),
    where the elements are returned (else None);
    ``tensor_scale`` NVFP4's (given, or computed), else None. ``key``: the key of
    stochastic rounding's draws (:func:`~amped.lowp.mx.element_round.hashed_uniform`), or
    None (to nearest). ``signs``: the Hadamard signs (float32, 16) where
    ``spec.hadamard``; the elements and values are then those of the rotated ``x``.

    ``block_factors`` (what each block is multiplied by before and after the rounding,
    float32, one per block) are returned so that a compiled kernel stores them once per
    block: Inductor otherwise recomputes them, ``exp2`` included, for every element
    (or every vector of elements) of the main loop, which made a cast along dim 0 three
    times slower. Callers ignore them.
    """
    xf = x.to(torch.float32)
    if spec.hadamard:
        assert signs is not None and spec.blocked_dim == 0
        xf = hadamard_rows(xf, signs)
    blocks, axes = _blocked(xf, spec)
    amax = _block_amax(blocks, axes, spec, fold=x.dtype is not torch.float32)
    if spec.is_mx:
        exponent = mx_exponent(amax, spec.element, spec.elem_emax, spec.scale_mode)
        multiplier = _mx_reciprocal(exponent, spec.scale_mode)
        scale_bits = exponent.to(torch.uint8)
        scale_value = e8m0_value(exponent)
    else:
        if tensor_scale is None:  # the tensor's amax is the largest block amax
            tensor_scale = nvfp4_tensor_scale(amax)
        ratio = (amax / 6.0 / tensor_scale).clamp(_E4M3_TINY, 448.0)
        ratio = _one_nan(ratio)
        scale = ratio.to(torch.float8_e4m3fn)
        scale_value = scale.to(torch.float32)
        multiplier = (1.0 / tensor_scale) / scale_value
        scale_bits = scale.view(torch.uint8)
    scaled = blocks * multiplier
    if key is not None:
        draw = hashed_uniform(key, x.shape)
        rounded = round_stochastic(scaled, spec.element, _blocked(draw, spec)[0])
    else:
        rounded = round_nearest(scaled, spec.element)
    values = kept = None
    if spec.values_dtype is not None:  # exact: at most 6 significant bits (block_values)
        values = rounded * scale_value
        # float32 values get one NaN canonicalisation; a conversion to bfloat16 gives
        # every NaN the same bits by itself, whatever its sign and payload (torch's
        # vector code 0xFFFF, its scalar code 0x7FC0), so there it would be wasted work
        if spec.values_dtype is not torch.bfloat16:
            values = _one_nan(values)
        values = values.to(spec.values_dtype).reshape(x.shape)
    if spec.elements_dtype is not None:
        kept = _one_nan(rounded).to(spec.elements_dtype).reshape(x.shape)
    # the scales' bits go with the elements (a cast of values only never reads them)
    kept_bits = None if kept is None else _scale_layout(scale_bits, spec, x.shape)
    return BlockKernelOutput(values, kept, kept_bits, tensor_scale, (multiplier, scale_value))
