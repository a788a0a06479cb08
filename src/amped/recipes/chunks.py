"""Chunks: parameters of one device and dtype stepped together through flat work tensors.

A multi-tensor optimizer step copies a chunk's gradients, weights and state into
flat float32 rows once, runs each stage of its algorithm as one op over the whole
chunk, and copies the results back. :func:`partition` cuts a parameter list into
chunks of bounded size; :func:`allocate` gives them work memory, allocated once per
device for the largest chunk, so the step's transient memory is bounded by a chunk,
not by the model. Used by :mod:`amped.recipes.compensated`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["Chunk", "allocate", "partition"]


class Chunk:
    """Parameters of one device and dtype, stepped together through flat work tensors.

    ``floats`` are float32 rows and ``noise`` int32 rows, each flat over the chunk's
    elements, parameter after parameter; ``views`` cuts each float32 row into one
    tensor per parameter, in its shape, for the copies in and out.
    """

    def __init__(
        self, params: list[torch.Tensor], floats: torch.Tensor, noise: torch.Tensor
    ) -> None:
        self.params = params
        self.dtype = params[0].dtype
        self.device = params[0].device
        self._sizes = [param.numel() for param in params]
        numel = sum(self._sizes)
        self.floats = floats[:, :numel].unbind(0)
        self.noise = noise[:, :numel].unbind(0)
        self.views = [self.cut(row) for row in self.floats]

    def cut(self, row: torch.Tensor) -> list[torch.Tensor]:
        """``row`` as one tensor per parameter, in its shape."""
        parts = row.split(self._sizes)
        return [part.view(p.shape) for part, p in zip(parts, self.params, strict=True)]

    def parts(self, row: torch.Tensor) -> Sequence[torch.Tensor]:
        """``row`` as one flat tensor per parameter."""
        return row.split(self._sizes)


def partition(params: list[torch.Tensor], most: int) -> list[list[torch.Tensor]]:
    """Chunks of one device and dtype, each in parameter order, of at most ``most``
    elements unless a single tensor is larger."""
    same: dict[tuple[torch.device, torch.dtype], list[list[torch.Tensor]]] = {}
    sizes: dict[tuple[torch.device, torch.dtype], int] = {}
    for param in params:
        key = (param.device, param.dtype)
        chunks = same.setdefault(key, [[]])
        if chunks[-1] and sizes[key] + param.numel() > most:
            chunks.append([])
            sizes[key] = 0
        chunks[-1].append(param)
        sizes[key] = sizes.get(key, 0) + param.numel()
    return [chunk for chunks in same.values() for chunk in chunks]


def allocate(
    plan: list[tuple[dict, list[torch.Tensor]]], floats: int, noise: int
) -> list[tuple[dict, Chunk]]:
    """``plan``'s chunks, on work memory allocated once per device, for the largest."""
    sizes: dict[torch.device, int] = {}
    for _, params in plan:
        device = params[0].device
        sizes[device] = max(sizes.get(device, 0), sum(p.numel() for p in params))
    work = {
        device: (
            torch.empty((floats, size), dtype=torch.float32, device=device),
            torch.empty((noise, size), dtype=torch.int32, device=device),
        )
        for device, size in sizes.items()
    }
    return [(group, Chunk(params, *work[params[0].device])) for group, params in plan]
