"""Attention's six matmuls, each in its role's format, on one tile.

A :class:`Roles` holds one call's inputs (``[B, H, T, D]``, K and V expanded to Q's heads)
and its casts of whole inputs (cast once, sliced per tile); its methods are the six
matmuls on a tile of query rows ``r0:r1`` and keys ``c0:c1``. Every scale is that of
the whole operand's region (or, under a safe mask, of the row's visible keys), never
the tile's: tiles are aligned at ``block_size``, as ``"block"`` regions and MX blocks
are, and a score's row or head amax is given beforehand (:attr:`Roles.score_amax`).
Query-indexed outputs (S, O, dP, dQ) take the causal-safe key-side casts of
:mod:`amped.lowp.attention_cast` where a mask hides keys; key-indexed ones (dV, dK) sum
over query rows, and their score operand is 0 wherever it is masked, so its scales see
visible positions only as they are.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from amped.lowp.attention_cast import (
    is_mx,
    key_groups,
    keys_cast,
    mx_cast,
    mx_keys_inner_matmul,
    operand_cast,
)
from amped.lowp.attention_config import AttentionCast, AttentionConfig
from amped.lowp.attention_health import RoleHealth

__all__ = ["Roles", "Tile"]


class Tile(NamedTuple):
    """Query rows ``r0:r1``, which keys each sees (None: every key), and the tile's
    keys ``c0:c1`` (``c1`` None: to the last)."""

    r0: int
    r1: int
    visible: torch.Tensor | None  # [B, H, rows, Tk] bool: every key, not only c0:c1
    c0: int = 0
    c1: int | None = None

    @property
    def keys(self) -> slice:
        return slice(self.c0, self.c1)


class Roles:
    """The matmuls of one attention call (see the module doc)."""

    def __init__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: AttentionConfig,
        health: RoleHealth | None = None,
    ) -> None:  # fmt: skip
        self.q, self.k, self.v = q, k, v
        self.config = config
        self.health = RoleHealth(None) if health is None else health
        self._role = ""  # the role running: its casts are counted under it
        self.dtype = q.dtype
        self._casts: dict[tuple[str, str, str, bool], torch.Tensor] = {}
        # "P" / "dS": each row's amax over every key, [B, H, T, 1] (a head's: the max
        # over its rows), given before the role's first tile
        self.score_amax: dict[str, torch.Tensor] = {}
        self._groups: dict[tuple[int, str, str, str], list[Any]] = {}

    def _whole(
        self, name: str, x: torch.Tensor, fmt: str, scaling: str, inner_t: bool
    ) -> torch.Tensor:
        """The cast of a whole input (``[B, H, T, D]``), cached per call: FP8 per region
        (``[B, H, T, D]``: a region's values are the same either way round), or MX along
        D, or with ``inner_t`` along T (as ``[B, H, D, T]``)."""
        mx = is_mx(fmt)
        key = (name, fmt, "" if mx else scaling, inner_t and mx)
        if key not in self._casts:
            high = x.mT if inner_t and mx else x
            if mx:
                cast = mx_cast(high, fmt)
            else:
                cast = operand_cast(x, fmt, scaling, self.config.block_size)
            self.health.cast(self._role, high, cast)
            self._casts[key] = cast.to(self.dtype)
        return self._casts[key]

    def _safe(self, tile: Tile) -> bool:
        return self.config.causal_safe and tile.visible is not None

    def score_cast(
        self, x: torch.Tensor, name: str, fmt: str, rule: AttentionCast, tile: Tile, t: bool
    ) -> torch.Tensor:
        """A tile's P or dS (``[B, H, rows, keys]``) cast; ``t``: as ``[B, H, keys, rows]``
        (inner dim the queries, for dV and dK). Under a safe mask, each query row of a
        query-indexed output is scaled on its own: other rows' scores depend on keys
        this row cannot see."""
        if is_mx(fmt):
            cast = mx_cast(x.mT if t else x, fmt)
            self.health.cast(self._role, x.mT if t else x, cast)
            return cast.to(self.dtype)
        per_row = self._safe(tile) and not t
        amax = None
        if rule.scaling != "block":
            rows = self.score_amax[name]  # [B, H, T, 1]: each row's, over every key
            # per row: the row's own; else each head's
            amax = rows[:, :, tile.r0 : tile.r1] if per_row else rows.amax(dim=2, keepdim=True)
            if rule.scaling == "tensorwise":
                amax = amax.amax(dim=(0, 1), keepdim=True)
        cast = operand_cast(x, fmt, rule.scaling, self.config.block_size, per_row, amax)
        self.health.cast(self._role, x, cast)
        return (cast.mT if t else cast).to(self.dtype)

    def _key_groups(
        self, name: str, keys: torch.Tensor, fmt: str, scaling: str, tile: Tile
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """:func:`key_groups` of the tile's query rows, found once for all its key tiles
        (only the current query tile's are kept)."""
        assert tile.visible is not None
        key = (tile.r0, name, fmt, scaling)
        if key not in self._groups:
            self._groups = {k: g for k, g in self._groups.items() if k[0] == tile.r0}
            block = self.config.block_size
            self._groups[key] = key_groups(keys, tile.visible, fmt, scaling, block)
        return self._groups[key]

    def _group_casts(
        self, name: str, keys: torch.Tensor, fmt: str, scaling: str, tile: Tile
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Each group's rows and its cast of the tile's keys (a slice of the group's whole
        cast: its scales come from all of the group's visible keys)."""
        cols = tile.keys
        for rows, seen, amax in self._key_groups(name, keys, fmt, scaling, tile):
            part = keys[:, :, cols]
            cast = keys_cast(part, seen[:, :, cols], fmt, scaling, self.config.block_size, amax)
            self.health.cast(self._role, torch.where(seen[:, :, cols], part, 0), cast)
            yield rows, cast.to(self.dtype)

    def _keys_outer(
        self,
        a: torch.Tensor,
        name: str,
        keys: torch.Tensor,
        fmt: str,
        rule: AttentionCast,
        tile: Tile,
    ) -> torch.Tensor:
        """``a @ cast(keys).mT`` with the tile's keys on the output's column dim (S, dP)."""
        cols = tile.keys
        if self._safe(tile) and not is_mx(fmt):
            out = a.new_empty((*a.shape[:-1], keys[:, :, cols].shape[2]))
            for rows, cast in self._group_casts(name, keys, fmt, rule.scaling, tile):
                out[:, :, rows] = a.index_select(2, rows) @ cast.mT
            return out
        return a @ self._whole(name, keys, fmt, rule.scaling, False)[:, :, cols].mT

    def _keys_inner(
        self,
        a: torch.Tensor,
        name: str,
        keys: torch.Tensor,
        fmt: str,
        rule: AttentionCast,
        tile: Tile,
    ) -> torch.Tensor:
        """``a @ cast(keys)`` with the tile's keys on the inner dim (O, dQ)."""
        cols = tile.keys
        if not self._safe(tile):
            whole = self._whole(name, keys, fmt, rule.scaling, True)
            return a @ (whole[..., cols].mT if is_mx(fmt) else whole[:, :, cols])
        assert tile.visible is not None
        if is_mx(fmt):
            common = self._whole(name, keys, fmt, rule.scaling, True)[..., cols]
            visible = tile.visible[..., cols]
            return mx_keys_inner_matmul(a, keys[:, :, cols], common, visible, fmt)
        out = a.new_empty((*a.shape[:-1], keys.shape[3]))
        for rows, cast in self._group_casts(name, keys, fmt, rule.scaling, tile):
            out[:, :, rows] = a.index_select(2, rows) @ cast
        return out

    def run(self, role: str, tile: Tile, *args: torch.Tensor) -> torch.Tensor:
        """Role ``role`` (``"s"``, ``"o"``, ...) on ``tile``: the method of that name, its
        casts and output reported to the call's :class:`RoleHealth`."""
        self._role = role
        out: torch.Tensor = getattr(self, role)(*args, tile)
        self.health.output(role, out)
        return out

    def s(self, tile: Tile) -> torch.Tensor:
        """``Q · Kᵀ`` of the tile (unscaled)."""
        q = self.q[:, :, tile.r0 : tile.r1]
        rule = self.config.rule("s")
        if rule is None:
            return q @ self.k[:, :, tile.keys].mT
        qc = self._whole("Q", self.q, rule.format, rule.scaling, False)[:, :, tile.r0 : tile.r1]
        return self._keys_outer(qc, "K", self.k, rule.format, rule, tile)

    def o(self, p: torch.Tensor, tile: Tile) -> torch.Tensor:
        """``P · V`` of the tile."""
        rule = self.config.rule("o")
        if rule is None:
            return p @ self.v[:, :, tile.keys]
        pc = self.score_cast(p, "P", rule.format, rule, tile, False)
        return self._keys_inner(pc, "V", self.v, rule.format, rule, tile)

    def dp(self, do: torch.Tensor, tile: Tile) -> torch.Tensor:
        """``dO · Vᵀ`` of the tile (``do``: the whole dO)."""
        rule = self.config.rule("dp")
        if rule is None:
            return do[:, :, tile.r0 : tile.r1] @ self.v[:, :, tile.keys].mT
        doc = self._whole("dO", do, rule.grad, rule.scaling, False)[:, :, tile.r0 : tile.r1]
        return self._keys_outer(doc, "V", self.v, rule.format, rule, tile)

    def dq(self, ds: torch.Tensor, tile: Tile) -> torch.Tensor:
        """``dS · K`` of the tile (unscaled)."""
        rule = self.config.rule("dq")
        if rule is None:
            return ds @ self.k[:, :, tile.keys]
        dsc = self.score_cast(ds, "dS", rule.grad, rule, tile, False)
        return self._keys_inner(dsc, "K", self.k, rule.format, rule, tile)

    def _key_indexed(
        self,
        x: torch.Tensor,
        name: str,
        y: torch.Tensor,
        y_name: str,
        y_fmt: str,
        x_fmt: str,
        rule: AttentionCast | None,
        tile: Tile,
    ) -> torch.Tensor:
        """``xᵀ · y`` over the tile's query rows (``x`` a score, ``y`` the whole Q or dO)."""
        if rule is None:
            return x.mT @ y[:, :, tile.r0 : tile.r1]
        xc = self.score_cast(x, name, x_fmt, rule, tile, True)
        yc = self._whole(y_name, y, y_fmt, rule.scaling, True)
        if is_mx(y_fmt):  # [B, H, D, T]: MX blocks along the queries
            return xc @ yc[..., tile.r0 : tile.r1].mT
        return xc @ yc[:, :, tile.r0 : tile.r1]

    def dv(self, p: torch.Tensor, do: torch.Tensor, tile: Tile) -> torch.Tensor:
        """``Pᵀ · dO`` over the tile's query rows."""
        rule = self.config.rule("dv")
        fmt, grad = (rule.format, rule.grad) if rule else ("", "")
        return self._key_indexed(p, "P", do, "dO", grad, fmt, rule, tile)

    def dk(self, ds: torch.Tensor, tile: Tile) -> torch.Tensor:
        """``dSᵀ · Q`` over the tile's query rows (unscaled)."""
        rule = self.config.rule("dk")
        fmt, grad = (rule.format, rule.grad) if rule else ("", "")
        return self._key_indexed(ds, "dS", self.q, "Q", fmt, grad, rule, tile)
