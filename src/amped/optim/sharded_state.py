"""8-bit moments of an FSDP2 shard, with the blocks of the unsharded tensor.

:mod:`amped.optim.quantized_state` cuts a moment, flattened, into blocks of
:data:`~amped.optim.quantized_state.BLOCK` (256) elements, each with one scale (its
largest magnitude). Under FSDP2 a rank holds some rows of each parameter; the rule
here keeps every element's state exactly what one process would keep:

- **Which tensors are 8-bit** is decided on the unsharded tensor
  (:func:`~amped.optim.quantized_state.quantizes` of its whole size), never on the
  shard: the same on 1 rank and on N.
- **Blocks** are the unsharded tensor's: element ``i`` of the flattened parameter is in
  block ``i // 256``. A shard that starts and ends on block boundaries (rows of a
  multiple of 256 elements, or shards of whole blocks) quantizes its own blocks, with
  no communication. Where some shard boundary falls inside a block (rows of 64
  elements, say, 17 of them on each of 2 ranks), the ranks holding a part of that
  block agree on its scale: one ``all_reduce(MAX)`` of the tensor's block maxima per
  moment and step, on that tensor only. Whether a tensor needs it follows from its
  shape and the mesh size alone, so every rank makes the same collectives.
- **Scales are stored by rows** (a DTensor of shape ``(rows, S)`` sharded like the
  parameter, so that DCP saves and reshards them with the rows): row ``g`` holds, in
  order, the scales of the ``S`` or fewer blocks its elements fall in (unused slots
  0). With rows of a multiple of 256 elements this is exactly one scale per block (4
  bytes per 256 elements); shorter rows repeat a block's scale on each of its rows:
  4 bytes a row, 1/16 byte an element for rows of 64, and 4 bytes an element for a
  1-D tensor, against 1/64 in one process.

Codes are a uint8 DTensor shaped and sharded like the parameter.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from amped.optim import quantized_state as q8
from amped.optim.shards import flat_start, local, rebuild

__all__ = ["ShardBlocks", "dequantize", "init_state", "store"]

_BLOCK = q8.BLOCK


class ShardBlocks:
    """Where a shard lies against its parameter's blocks (see the module).

    Attributes:
        first: the unsharded tensor's number of the shard's first block.
        count: how many blocks the shard touches, whole or in part.
        lead: elements of the first block before the shard starts.
        shared: whether some rank's shard boundary falls inside a block (the ranks
            then agree on scales with an all-reduce).
        slots: for each local row and slot, the shard's number of the block whose
            scale is kept there, -1 for an unused slot; ``(local rows, S)``.
    """

    def __init__(self, param: torch.Tensor) -> None:
        numel, rows = param.numel(), param.shape[0]
        self.cols = numel // rows
        shard = local(param)
        start, size = flat_start(param), shard.numel()
        self.size = size
        self.first = start // _BLOCK
        self.count = -(-(start + size) // _BLOCK) - self.first if size else 0
        self.lead = start - self.first * _BLOCK
        self.total_blocks = numel // _BLOCK
        mesh: Any = param.device_mesh  # type: ignore[attr-defined]
        self.group = mesh.get_group()
        world = mesh.size()
        per_rank = -(-rows // world)
        boundaries = (min(r * per_rank, rows) * self.cols for r in range(1, world))
        self.shared = any(b % _BLOCK for b in boundaries)
        width = _slots_per_row(rows, self.cols)
        self.width = width
        first_row = start // self.cols if self.cols else 0
        g = torch.arange(first_row, first_row + shard.shape[0] if shard.dim() else 0)
        row_first = (g * self.cols) // _BLOCK
        row_last = ((g + 1) * self.cols - 1) // _BLOCK
        block = row_first.view(-1, 1) + torch.arange(width).view(1, -1)
        used = block <= row_last.view(-1, 1)
        self.slots = torch.where(used, block - self.first, -1).to(param.device)

    def padded(self, values: torch.Tensor, fill: torch.Tensor | None = None) -> torch.Tensor:
        """The shard's flat ``values`` in ``count`` whole blocks; the elements of other
        ranks in its first and last block are 0, or ``fill``'s first and last entry."""
        out = values.new_zeros(self.count * _BLOCK)
        out[self.lead : self.lead + self.size] = values.reshape(-1)
        if fill is not None and self.count:
            out[: self.lead] = fill[0]
            out[self.lead + self.size :] = fill[-1]
        return out

    def block_maxima(self, values: torch.Tensor) -> torch.Tensor:
        """Each touched block's largest magnitude over every rank's part of it
        (a collective when ``shared``)."""
        mine = self.padded(values).view(-1, _BLOCK).abs().amax(-1)
        if not self.shared:
            return mine
        every = torch.zeros(self.total_blocks, dtype=torch.float32, device=values.device)
        every[self.first : self.first + self.count] = mine
        dist.all_reduce(every, op=dist.ReduceOp.MAX, group=self.group)
        return every[self.first : self.first + self.count]

    def to_slots(self, scales: torch.Tensor) -> torch.Tensor:
        """Per-block ``scales`` into the row slots (see the module)."""
        picked = scales[self.slots.clamp(min=0)] if scales.numel() else scales.new_zeros(1)
        return torch.where(self.slots >= 0, picked, 0.0)

    def from_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """The per-block scales kept in the row ``slots``."""
        scales = slots.new_zeros(self.count)
        used = self.slots >= 0
        scales[self.slots[used]] = slots[used]
        return scales


_LAYOUTS = WeakIdKeyDictionary()  # parameter -> ShardBlocks (tensors compare by value)


def _blocks(param: torch.Tensor) -> ShardBlocks:
    """``param``'s :class:`ShardBlocks`, made once (a shard's place does not change)."""
    blocks: ShardBlocks | None = _LAYOUTS.get(param)
    if blocks is None:
        blocks = _LAYOUTS[param] = ShardBlocks(param)
    return blocks


@functools.lru_cache(maxsize=4096)
def _slots_per_row(rows: int, cols: int) -> int:
    """The most blocks one row touches (the pattern repeats every 256 rows)."""
    g = torch.arange(min(rows, _BLOCK))
    return int(((((g + 1) * cols - 1) // _BLOCK) - (g * cols) // _BLOCK + 1).max())


def init_state(param: torch.Tensor, state: dict, key: str) -> None:
    """Zero codes and scales of moment ``key`` for the DTensor ``param``."""
    blocks = _blocks(param)
    state[f"{key}_codes"] = torch.zeros_like(param, dtype=torch.uint8)
    shard = torch.zeros(blocks.slots.shape, dtype=torch.float32, device=blocks.slots.device)
    state[f"{key}_scale"] = rebuild(param, shard, torch.Size((param.shape[0], blocks.width)))


def dequantize(param: torch.Tensor, state: dict, key: str, signed: bool) -> torch.Tensor:
    """Moment ``key`` of ``param``'s local shard, in float32 (local shape)."""
    blocks = _blocks(param)
    codes = local(state[f"{key}_codes"])
    scales = blocks.from_slots(local(state[f"{key}_scale"]))
    padded = blocks.padded(codes)
    values = q8.dequantize(padded, scales, signed)
    return values[blocks.lead : blocks.lead + blocks.size].view(codes.shape)


def store(param: torch.Tensor, state: dict, key: str, signed: bool, value: torch.Tensor) -> None:
    """Quantize float32 ``value`` (the local shard's moment) into ``state``'s codes and
    scales of ``key``: bit for bit what one process stores for these elements."""
    blocks = _blocks(param)
    # The other ranks' elements of a shared block are filled with the block's maximum:
    # quantize then finds the whole block's scale, and divides by exactly that.
    fill = blocks.block_maxima(value)
    codes, scales = q8.quantize(blocks.padded(value, fill if blocks.count else None), signed)
    local(state[f"{key}_codes"]).copy_(
        codes[blocks.lead : blocks.lead + blocks.size].view(value.shape)
    )
    local(state[f"{key}_scale"]).copy_(blocks.to_slots(scales))
