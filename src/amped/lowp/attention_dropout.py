"""Attention dropout as torch's SDPA applies it, tile by tile: ``P`` (the softmax) is
multiplied by ``keep / (1 - p)``, ``keep`` true with probability ``1 - p``, before
``O = P·V``; the backward uses the same mask.

The mask is never held whole. Each call draws one seed from the device's default
generator (so ``torch.manual_seed`` makes a run repeatable, and each call draws a new
mask, as torch's dropout does); the tile of query rows ``r0:`` and keys ``c0:`` draws
its part of the mask from a generator seeded with ``seed`` and the tile's position, so
forward and backward regenerate the same bits. :func:`keep_mask` builds the whole mask
of a seed, for a reference.
"""

from __future__ import annotations

import torch

from amped.lowp.attention_roles import Tile

__all__ = ["Dropout", "keep_mask"]


class Dropout:
    """One attention call's dropout: probability ``p``, the call's ``seed``."""

    def __init__(self, p: float, seed: int, shape: tuple[int, ...], device: torch.device):
        self.p, self.seed, self.shape, self.device = p, seed, shape, device

    @classmethod
    def draw(cls, p: float, shape: tuple[int, ...], device: torch.device) -> Dropout | None:
        """The dropout of a call with ``dropout_p = p`` on scores of ``shape`` ([B, H, Tq,
        Tk]); None for ``p == 0``. Draws the seed from ``device``'s default generator."""
        if not 0.0 <= p <= 1.0:  # torch's dropout error, type and message
            raise RuntimeError(f"dropout probability has to be between 0 and 1, but got {p}")
        if p == 0.0:
            return None
        seed = int(torch.empty((), dtype=torch.int64, device=device).random_(2**62))
        return cls(p, seed, shape, device)

    def keep(self, tile: Tile) -> torch.Tensor:
        """The tile's mask (``[B, H, rows, keys]``, True: kept)."""
        b, h, _, tk = self.shape
        c1 = tk if tile.c1 is None else tile.c1
        g = torch.Generator(self.device)
        g.manual_seed(self.seed + tile.r0 * tk + tile.c0)  # one stream per tile
        u = torch.rand((b, h, tile.r1 - tile.r0, c1 - tile.c0), generator=g, device=self.device)
        return u >= self.p  # kept with probability 1 - p

    def apply(self, x: torch.Tensor, tile: Tile) -> torch.Tensor:
        """``x * keep / (1 - p)`` on the tile (0 where dropped; all 0 for p = 1)."""
        scale = 0.0 if self.p == 1.0 else 1.0 / (1.0 - self.p)
        return torch.where(self.keep(tile), x * scale, 0.0)


def keep_mask(seed: int, p: float, shape: tuple[int, ...], block: int) -> torch.Tensor:
    """The whole keep mask (``[B, H, Tq, Tk]``) of a call with ``seed``, ``p`` and tiles
    of ``block`` (the config's ``block_size``), on the CPU."""
    drop = Dropout(p, seed, shape, torch.device("cpu"))
    tq, tk = shape[2], shape[3]
    rows = []
    for r in range(0, tq, block):
        tiles = [
            Tile(r, min(r + block, tq), None, c, min(c + block, tk)) for c in range(0, tk, block)
        ]
        rows.append(torch.cat([drop.keep(t) for t in tiles], dim=3))
    return torch.cat(rows, dim=2)
