"""Attention's operand casts: FP8 per region, MXFP8 per 32, and the causal-safe casts.

Every operand is cast as ``[B, H, rows, inner]`` (the matmul's inner dim last) and
returned as its *values* in float32: the FP8 or MX element times the inverse of its
scale, exact (scales are powers of two), so an emulated matmul multiplies them in
float32 and needs no scale afterwards. The casts are amped's own:
:func:`amped.lowp.float8.fp8_kernel.fp8_values` (what
:func:`amped.lowp.float8.cast.quantize` runs) with a scale from
:func:`amped.lowp.float8.cast.amax_to_scale` (``power_of_2=True``), and
:func:`amped.lowp.mx.block_cast.quantize_block` (``rceil``).

FP8 scaling regions (:func:`region_amax`): ``"tensorwise"`` the whole operand, ``"head"``
each ``[b, h]`` slice, ``"block"`` tiles of ``block x block`` (rows x inner), aligned at
0. ``per_row`` narrows a region to one row (the causal-safe query-side casts).

**Causal-safe key-side casts.** K and V are shared by every query row, and a mask hides
some keys from some rows. The safe cast of K (or V) *as row t sees it* is the cast of
``where(visible[t], K, 0)``: its scales come from visible keys only, so a masked key
cannot move the grid of a visible one. Rows whose scales come out equal share one cast
(:func:`fp8_key_groups`: a row's scale is a function of its own amax, and the union of
the visible sets of rows with equal scales has the same scale again), which keeps a
causal mask to a handful of casts per query tile. MX blocks run along the inner dim, so
only K and V with keys on the inner dim (``o`` and ``dq``) mix keys in a block; those
blocks a tile's rows see partly are cast once per row (:func:`mx_keys_inner_matmul`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from amped.lowp.attention_config import MX_BLOCK
from amped.lowp.float8 import fp8_kernel
from amped.lowp.float8.cast import amax_to_scale
from amped.lowp.mx.block_cast import quantize_block
from amped.lowp.mx.block_format import BLOCK_FORMATS

__all__ = [
    "fp8_cast",
    "fp8_key_groups",
    "is_mx",
    "key_groups",
    "keys_cast",
    "mx_cast",
    "mx_keys_inner_matmul",
    "operand_cast",
    "region_amax",
]

_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def is_mx(fmt: str) -> bool:
    """Whether ``fmt`` is a block (MX) format."""
    return fmt.startswith("mx")


def _pad_to(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    """``x`` padded with zeros along ``dim`` to a multiple of ``multiple``."""
    extra = -x.shape[dim] % multiple
    if not extra:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, extra]
    return F.pad(x, pad)


def region_amax(mag: torch.Tensor, scaling: str, block: int, per_row: bool) -> torch.Tensor:
    """The amax of each FP8 scaling region of ``mag`` (``|x|``, ``[B, H, R, K]``),
    broadcastable to it."""
    if scaling == "tensorwise":
        return mag.amax(dim=(0, 1, 3) if per_row else (0, 1, 2, 3), keepdim=True)
    if scaling == "head":
        return mag.amax(dim=3 if per_row else (2, 3), keepdim=True)
    rows, inner = mag.shape[-2:]
    tiles = _pad_to(mag, 3, block).unflatten(3, (-1, block))  # [B, H, R, nk, block]
    if per_row:
        return tiles.amax(dim=4, keepdim=True).expand_as(tiles).flatten(3)[..., :inner]
    tiles = _pad_to(tiles, 2, block).unflatten(2, (-1, block))  # [B, H, nr, block, nk, block]
    amax = tiles.amax(dim=(3, 5), keepdim=True).expand_as(tiles)
    return amax.flatten(4).flatten(2, 3)[..., :rows, :inner]


def fp8_cast(x: torch.Tensor, fmt: str, amax: torch.Tensor) -> torch.Tensor:
    """The float32 values of ``x`` cast to FP8 ``fmt`` with the power-of-two scales of
    ``amax`` (broadcastable to ``x``), divided by their scales (exact)."""
    dtype = _FP8[fmt]
    scale = amax_to_scale(amax, dtype, power_of_2=True)
    with torch.no_grad():
        values = fp8_kernel.values_kernel((dtype, torch.float32), x.to(torch.float32), scale)
    return values / scale


def mx_cast(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """The float32 values of ``x`` cast to MX ``fmt``, blocks of 32 along the last dim
    (zero-padded to a multiple of 32; zeros change no block's scale)."""
    inner = x.shape[-1]
    cast = quantize_block(_pad_to(x.to(torch.float32), x.dim() - 1, MX_BLOCK), BLOCK_FORMATS[fmt])
    return cast.block_values(torch.float32)[..., :inner]


def operand_cast(
    x: torch.Tensor,
    fmt: str,
    scaling: str,
    block: int,
    per_row: bool = False,
    amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` (``[B, H, R, K]``) cast to ``fmt``: MX along K, or FP8 with the amax of
    each scaling region (``amax`` given: that one)."""
    if is_mx(fmt):
        return mx_cast(x, fmt)
    if amax is None:
        amax = region_amax(x.detach().abs(), scaling, block, per_row)
    return fp8_cast(x, fmt, amax)


def _row_key_amax(
    keys: torch.Tensor, visible: torch.Tensor, scaling: str, block: int
) -> torch.Tensor:
    """Per query row, the amax of each region of ``keys`` (``[B, H, Tk, D]``) over the
    keys the row sees (``visible``: ``[B, H, rows, Tk]``): ``[rows, regions]``."""
    mag = keys.detach().abs()
    if scaling == "block":
        per_key = _pad_to(mag, 3, block).unflatten(3, (-1, block)).amax(dim=4)  # [B,H,Tk,nd]
    else:
        per_key = mag.amax(dim=3, keepdim=True)  # [B, H, Tk, 1]
    seen = torch.where(visible.unsqueeze(-1), per_key.unsqueeze(2), 0)  # [B,H,rows,Tk,nd]
    if scaling == "block":
        amax = _pad_to(seen, 3, block).unflatten(3, (-1, block)).amax(dim=4)
    else:
        amax = seen.amax(dim=3)
        if scaling == "tensorwise":
            amax = amax.amax(dim=(0, 1), keepdim=True)
    return amax.movedim(2, 0).flatten(1)


def key_groups(
    keys: torch.Tensor, visible: torch.Tensor, fmt: str, scaling: str, block: int
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """The causal-safe FP8 casts of ``keys`` (K or V, ``[B, H, Tk, D]``) for a tile's rows,
    as ``(rows, seen, amax)``: the cast for ``rows`` is :func:`keys_cast` of ``keys``
    with every key not in ``seen`` (``[B, H, Tk, 1]``, the keys some row of ``rows``
    sees) set to 0, whose scales are those of each row's own visible keys. ``amax``:
    the region amax of a ``"tensorwise"`` or ``"head"`` cast (None for ``"block"``,
    whose regions of ``block`` keys a key tile aligned at ``block`` holds whole), so
    that any slice of keys casts as the whole would (:func:`keys_cast`)."""
    scale = amax_to_scale(_row_key_amax(keys, visible, scaling, block), _FP8[fmt], True)
    _, group = torch.unique(scale, dim=0, return_inverse=True)
    per_key = keys.detach().abs().amax(dim=3, keepdim=True)  # [B, H, Tk, 1]
    out = []
    for g in range(int(group.max()) + 1):
        rows = (group == g).nonzero().flatten()
        seen = visible.index_select(2, rows).any(dim=2).unsqueeze(-1)  # [B, H, Tk, 1]
        amax = None
        if scaling != "block":  # the amax of where(seen, keys, 0), per region
            amax = torch.where(seen, per_key, 0).amax(dim=(2, 3), keepdim=True)
            if scaling == "tensorwise":
                amax = amax.amax(dim=(0, 1), keepdim=True)
        out.append((rows, seen, amax))
    return out


def keys_cast(
    keys: torch.Tensor, seen: torch.Tensor, fmt: str, scaling: str, block: int,
    amax: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """The cast of one of :func:`key_groups` (``keys`` and ``seen`` may be a slice of
    keys aligned at ``block``: the same values as that slice of the whole cast)."""
    return operand_cast(torch.where(seen, keys, 0), fmt, scaling, block, amax=amax)


def fp8_key_groups(
    keys: torch.Tensor, visible: torch.Tensor, fmt: str, scaling: str, block: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`key_groups` cast whole: ``(rows, values)`` pairs, ``values`` the cast of
    ``keys`` with every key none of ``rows`` sees set to 0."""
    return [
        (rows, keys_cast(keys, seen, fmt, scaling, block, amax))
        for rows, seen, amax in key_groups(keys, visible, fmt, scaling, block)
    ]


def mx_keys_inner_matmul(
    a: torch.Tensor, keys: torch.Tensor, common: torch.Tensor, visible: torch.Tensor, fmt: str
) -> torch.Tensor:
    """``a @ cast(keys)`` for an MX role with keys on the inner dim (``o``: P·V, ``dq``:
    dS·K), causal-safe: ``a`` is ``[B, H, rows, Tk]`` (cast already, 0 where not
    visible), ``keys`` ``[B, H, Tk, D]``, ``common`` the cast of ``keys.mT`` unmasked.

    A 32-key block that every row sees whole, or not at all, uses ``common``; a block
    some row sees in part is cast once per row, with the keys that row cannot see set to
    0 (the row's own cast of its visible keys).
    """
    tk = keys.shape[2]
    vis = _pad_to(visible, 3, MX_BLOCK).unflatten(3, (-1, MX_BLOCK))
    partial = (vis.any(dim=4) & ~vis.all(dim=4)).flatten(0, 2).any(dim=0)  # [blocks]
    in_partial = partial.repeat_interleave(MX_BLOCK)[:tk]
    whole = torch.where(in_partial, 0, a) @ common.mT
    if not bool(partial.any()):
        return whole
    index = in_partial.nonzero().flatten()
    seen = torch.where(
        visible.index_select(3, index).unsqueeze(3),  # [B, H, rows, 1, n]
        keys.index_select(2, index).mT.unsqueeze(2),  # [B, H, 1, D, n]
        0,
    )
    per_row = mx_cast(seen, fmt)  # blocks of 32 keys: the partial blocks, in order
    return whole + torch.einsum("bhqk,bhqdk->bhqd", a.index_select(3, index), per_row)
