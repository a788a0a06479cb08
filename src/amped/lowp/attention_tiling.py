"""How attention is tiled: which keys each query row sees, tile by tile, and the
log-sum-exp of a tile's rows computed over key tiles (an online softmax).

A query tile is ``block_size`` rows; each is cut into key tiles of ``block_size`` keys,
so a tile's scores are ``[B, H, block_size, block_size]`` whatever the sequence length
and memory grows linearly with it, as FlashAttention's does. Tiles are aligned at
multiples of ``block_size``, as the ``"block"`` scaling regions and MX blocks of 32 are,
so no scaling region straddles two tiles. A key tile no row of a query tile sees (the
upper triangle of a causal mask) is skipped: it adds only zeros.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from amped.lowp.attention_roles import Tile

__all__ = ["Mask", "online_lse"]


class Mask:
    """Which keys each query row sees, and the float mask's bias, tile by tile."""

    def __init__(
        self, attn_mask: torch.Tensor | None, is_causal: bool, shape: tuple[int, ...],
        dtype: torch.dtype, block: int, device: torch.device,
    ) -> None:  # fmt: skip
        self.shape, self.is_causal, self.block, self.device = shape, is_causal, block, device
        self.visible: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        if attn_mask is None:
            return
        if attn_mask.dtype == torch.bool:
            self.visible = None if bool(attn_mask.all()) else attn_mask.expand(shape)
            return
        self.bias = attn_mask.to(dtype).expand(shape)
        # -inf masks, and so does the dtype's lowest value (masks built as
        # finfo.min, which makes exp underflow to exactly 0 all the same)
        masked = attn_mask <= torch.finfo(attn_mask.dtype).min
        self.visible = ~masked.expand(shape) if bool(masked.any()) else None

    @property
    def masks(self) -> bool:
        return self.is_causal or self.visible is not None

    def query_tiles(self) -> list[Tile]:
        """The query tiles, each with every key (``c0:c1`` all)."""
        tq = self.shape[2]
        return [self._rows(r, min(r + self.block, tq)) for r in range(0, tq, self.block)]

    def _rows(self, r0: int, r1: int) -> Tile:
        """Rows ``r0:r1``; a causal mask and an ``attn_mask`` together mask what either
        masks, as torch's default SDPA backend does (its math backend refuses both)."""
        visible = None if self.visible is None else self.visible[:, :, r0:r1]
        if self.is_causal:
            b, h, _, tk = self.shape
            device = self.device
            rows = torch.arange(r0, r1, device=device).unsqueeze(1)
            causal = (torch.arange(tk, device=device) <= rows).expand(b, h, r1 - r0, tk)
            visible = causal if visible is None else causal & visible
        return Tile(r0, r1, visible)

    def key_tiles(self, tile: Tile) -> Iterator[Tile]:
        """``tile``'s key tiles that some row of it sees."""
        tk = self.shape[3]
        for c0 in range(0, tk, self.block):
            c1 = min(c0 + self.block, tk)
            if tile.visible is not None and not bool(tile.visible[..., c0:c1].any()):
                continue
            yield tile._replace(c0=c0, c1=c1)

    def logits(self, qk: torch.Tensor, scale: float, tile: Tile) -> torch.Tensor:
        """``scale * qk + bias``, -inf where masked, for the tile's rows and keys."""
        s = qk * scale
        if self.bias is not None:
            s = s + self.bias[:, :, tile.r0 : tile.r1, tile.keys]
        if tile.visible is not None:
            s = torch.where(tile.visible[..., tile.keys], s, -math.inf)
        return s


def online_lse(blocks: Iterator[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """Each row's log-sum-exp over its key tiles' logits ``blocks`` (``[B, H, rows, 1]``;
    ``like`` a tensor of that shape): a running max ``m`` and sum ``l`` of
    ``exp(s - m)``, rescaled by ``exp(m_old - m_new)`` where the max grows. A row that
    sees no key gets +inf (its P is then 0, as torch's SDPA gives)."""
    m = torch.full_like(like, -math.inf)
    total = torch.zeros_like(like)
    for s in blocks:
        new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        # a row that has seen nothing yet keeps m = -inf: shift by 0 there, not by
        # -inf (exp(-inf - -inf) would be NaN); its exp(s - 0) are exact zeros
        shift = torch.where(torch.isneginf(new), 0, new)
        total = total * torch.exp(m - shift) + torch.exp(s - shift).sum(-1, keepdim=True)
        m = new
    empty = torch.isneginf(m)
    return torch.where(empty, math.inf, m + torch.log(torch.where(empty, 1, total)))
