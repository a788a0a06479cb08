"""Chunks: parameters of one device and dtype stepped together through flat work tensors.

A multi-tensor optimizer step copies a chunk's gradients, weights and state into
flat float32 rows once, runs each stage of its algorithm as one op over the whole
chunk, and copies the results back. :class:`Plan` cuts the parameters into chunks of
at most ``most`` elements (a contiguous tensor larger than that is cut into pieces;
another one makes a chunk of its own) and gives them work memory, one block per
device for the largest chunk. The plan and its work memory are kept from step to
step while the parameters keep their gradients, shapes and layouts: building the
views costs more than a small model's arithmetic, and a fresh block of a few MiB is
handed back to the system and faulted in again at every step. Used by
:mod:`amped.optim.compensated` and :mod:`amped.optim.master_step`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple

import torch

from amped.optim import state_layout
from amped.optim.shards import flat_start, is_sharded, local

__all__ = ["Chunk", "Groups", "Piece", "Plan", "partition"]

_INT32 = 1 << 32
Groups = list[tuple[dict, list[torch.Tensor]]]  # parameter groups, each with its params to step
Splittable = Callable[[torch.Tensor], bool]


class Piece(NamedTuple):
    """Elements ``start`` to ``stop`` of ``param`` in memory order (``whole``: all)."""

    param: torch.Tensor
    start: int
    stop: int
    whole: bool


class Chunk:
    """Pieces of parameters of one device and dtype, stepped together in work rows.

    ``floats`` are float32 rows and ``noise`` int32 rows, each flat over the chunk's
    elements, piece after piece; ``views`` cuts each float32 row into one tensor per
    piece (in the parameter's shape when the piece is whole), for the copies in and
    out; ``rounded`` cuts each noise row likewise, as float32 (stochastic rounding
    leaves its results there). ``counters`` holds 0, 1, ... and ``scratch`` is a spare
    int32 row; ``first`` numbers the chunk's first element among the step's bfloat16
    elements on its device (see :mod:`amped.optim.noise`), as an int32.
    """

    def __init__(self, pieces: list[Piece], work: torch.Tensor | None, floats: int) -> None:
        self.pieces = pieces
        self.owners = [piece.param for piece in pieces]
        self.dtype = self.owners[0].dtype
        self.device = self.owners[0].device
        self.first = 0
        self._sizes = [piece.stop - piece.start for piece in pieces]
        self._shapes = [local(p.param).shape if p.whole else (p.stop - p.start,) for p in pieces]
        numel = sum(self._sizes)
        self.floats: list[torch.Tensor] = []
        self.noise: list[torch.Tensor] = []
        self.views: list[list[torch.Tensor]] = []
        self.rounded: list[list[torch.Tensor]] = []
        if work is not None:  # else a chunk of the fused step only (see gather_rows)
            self.floats = list(work[:floats, :numel].unbind(0))
            ints = work[floats:, :numel].view(torch.int32).unbind(0)
            *self.noise, self.scratch, self.counters = ints
            self.views = [self.cut(row) for row in self.floats]
            self.rounded = [self.cut(row.view(torch.float32)) for row in self.noise]
        self._gather: dict[tuple[int, torch.dtype], tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self._first: torch.Tensor | None = None
        self._flat: dict[int, tuple[tuple[int, ...], torch.Tensor | None]] = {}

    @property
    def numel(self) -> int:
        return sum(self._sizes)

    def take(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each piece's part of the matching tensor of ``tensors`` (one per piece, laid
        out like its parameter: a gradient, a state tensor); of a DTensor (an FSDP2
        shard), the part of its local shard."""
        return [
            local(tensor) if piece.whole else local(tensor).view(-1)[piece.start : piece.stop]
            for tensor, piece in zip(tensors, self.pieces, strict=True)
        ]

    def gather_row(
        self, slot: int, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A flat row of ``dtype`` (the chunk's by default) over its elements, with its
        views per piece, for the fused step to gather a column into (its gradients, say):
        a tensor of its own per ``slot`` and dtype, made on first use and kept with the
        chunk. Separate tensors, not parts of one: the compiled kernel's inputs must not
        share memory, or it compiles again for the aliasing."""
        key = (slot, dtype or self.dtype)
        kept = self._gather.get(key)
        if kept is None:
            row = torch.empty(self.numel, dtype=key[1], device=self.device)
            kept = self._gather[key] = (row, self.cut(row))
        return kept

    def flat(self, slot: int, parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """:func:`amped.optim.state_layout.flat` of ``parts`` (one tensor per piece),
        kept per ``slot`` while the parts' addresses stay the same: for the optimizer's
        own state only, since the kept view holds its memory (a gradient's would outlive
        ``zero_grad``)."""
        addresses = tuple(part.data_ptr() for part in parts)
        kept = self._flat.get(slot)
        if kept is None or kept[0] != addresses:
            kept = (addresses, state_layout.flat(parts))
            self._flat[slot] = kept
        return kept[1]

    def first_number(self) -> torch.Tensor:
        """``first`` as a 0-dim int32 tensor on the chunk's device (kept)."""
        if self._first is None:
            self._first = torch.tensor(self.first, dtype=torch.int32, device=self.device)
        return self._first

    def cut(self, row: torch.Tensor) -> list[torch.Tensor]:
        """``row`` as one tensor per piece, in its shape."""
        parts = row.split(self._sizes)
        return [part.view(shape) for part, shape in zip(parts, self._shapes, strict=True)]


def partition(
    params: list[torch.Tensor], most: int, splittable: Splittable, alone: int | None = None
) -> list[list[Piece]]:
    """Chunks of one device and dtype, each in parameter order, of at most ``most``
    elements: a larger parameter is cut into pieces if ``splittable``, else alone. With
    ``alone``, a splittable parameter of at least that many elements (and at most
    ``most``) is a chunk of its own, whose rows are its own memory (no copies)."""
    same: dict[tuple[torch.device, torch.dtype], list[list[Piece]]] = {}
    room: dict[tuple[torch.device, torch.dtype], int] = {}
    for param in params:
        key, numel = (param.device, param.dtype), local(param).numel()
        chunks = same.setdefault(key, [[]])
        left = room.get(key, most)
        if is_sharded(param):
            # A shard's elements are numbered by their place in the whole parameter
            # (see Plan._build), which only chunks of its own can follow.
            step = most if numel > most and splittable(param) else max(numel, 1)
            for start in range(0, numel, step):
                stop = min(numel, start + step)
                chunks.append([Piece(param, start, stop, stop - start == numel)])
            chunks.append([])
            room[key] = most
        elif alone is not None and alone <= numel <= most and splittable(param):
            chunks.append([Piece(param, 0, numel, True)])
            chunks.append([])
            room[key] = most
        elif numel <= left:
            chunks[-1].append(Piece(param, 0, numel, True))
            room[key] = left - numel
        elif numel > most and splittable(param):
            start = 0
            while start < numel:
                if left == 0:
                    chunks.append([])
                    left = most
                stop = min(numel, start + left)
                chunks[-1].append(Piece(param, start, stop, False))
                left, start = left - (stop - start), stop
            room[key] = left
        else:
            chunks.append([Piece(param, 0, numel, True)])
            room[key] = max(most - numel, 0)
    return [chunk for chunks in same.values() for chunk in chunks if chunk]


class Plan:
    """The chunks of a step, rebuilt only when the parameters' signature changes.

    Args:
        floats: float32 work rows a chunk needs.
        noise: int32 rows for random bits (two more are added: scratch, counters).
    """

    def __init__(
        self, floats: int, noise: int, *, rows: bool = True, alone: int | None = None
    ) -> None:
        self._floats, self._rows = floats, floats + noise + 2
        self._with_rows = rows  # False: chunks without work rows (the fused step's)
        self._alone = alone  # see partition
        self._signature: Hashable = None
        self._chunks: list[tuple[dict, Chunk]] = []

    def chunks(self, groups: Groups, most: int, splittable: Splittable) -> list[tuple[dict, Chunk]]:
        """``groups`` (each a parameter group and its parameters to step) in chunks."""
        signature = (
            most,
            *(
                (index, tuple(_signature(p, splittable) for p in params))
                for index, (_, params) in enumerate(groups)
            ),
        )
        if signature != self._signature:
            self._chunks = self._build(groups, most, splittable)
            self._signature = signature
        return self._chunks

    def twin(self, chunk: Chunk) -> Chunk:
        """``chunk``'s pieces with this plan's rows, in work memory of their own (freed
        with the twin): how a chunk of another plan takes a step that needs more rows."""
        work = self._work(chunk.device, chunk.numel)
        twin = Chunk(chunk.pieces, work, self._floats)
        twin.first = chunk.first
        return twin

    def _work(self, device: torch.device, size: int) -> torch.Tensor:
        work = torch.empty((self._rows, size), dtype=torch.float32, device=device)
        counters = work[-1].view(torch.int32)
        torch.arange(size, dtype=torch.int32, device=device, out=counters)
        return work

    def _build(self, groups: Groups, most: int, splittable: Splittable) -> list[tuple[dict, Chunk]]:
        self._chunks = []  # free the old work memory first
        plan = [
            (g, pieces)
            for g, params in groups
            for pieces in partition(params, most, splittable, self._alone)
        ]
        sizes: dict[torch.device, int] = {}
        for _, pieces in plan:
            device = pieces[0].param.device
            sizes[device] = max(sizes.get(device, 0), sum(p.stop - p.start for p in pieces))
        work = {}
        if self._with_rows:
            work = {device: self._work(device, size) for device, size in sizes.items()}
        chunks = [
            (g, Chunk(pieces, work.get(pieces[0].param.device), self._floats)) for g, pieces in plan
        ]
        # A chunk's first element is numbered by its place among the step's bfloat16
        # elements of its device, counted over whole parameters (an FSDP2 shard's by its
        # place in its unsharded parameter), so the numbers do not depend on the mesh.
        counted: dict[torch.device, int] = {}
        firsts: dict[torch.Tensor, int] = {}
        for _, chunk in chunks:
            if chunk.dtype is not torch.bfloat16:
                continue
            for param in chunk.owners:
                if param not in firsts:
                    firsts[param] = counted.get(chunk.device, 0)
                    counted[chunk.device] = firsts[param] + param.numel()
            piece = chunk.pieces[0]
            first = firsts[piece.param] + flat_start(piece.param) + piece.start
            chunk.first = (first + _INT32 // 2) % _INT32 - _INT32 // 2
        return chunks


def _signature(param: torch.Tensor, splittable: Splittable) -> Hashable:
    return (id(param), param.dtype, param.device, param.shape, splittable(param))
