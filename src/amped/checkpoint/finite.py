"""No poisoned checkpoint: find the first non-finite tensor in a state about to be saved.

A job that "succeeds" after its parameters went NaN writes a checkpoint that poisons
every run resumed from it, and nothing says so until days later. The checkpoint
writers (:func:`amped.checkpoint.save_checkpoint`, the integrations' save paths) look at
every floating tensor of what they are about to write (parameters, optimizer state,
masters, compensations) and refuse a non-finite one, naming it.

The flags are computed on each tensor's device and brought to the host once per
device (one sync each), not once per tensor.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["first_nonfinite", "nonfinite_message"]


def _leaves(obj: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in nested dicts, lists and tuples, with its path, depth first."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _leaves(value, f"{path}[{key!r}]")
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            yield from _leaves(value, f"{path}[{index}]")


def _all_finite(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_sparse:
        tensor = tensor.coalesce().values()
    if tensor.dtype.itemsize == 1 or tensor.is_complex():  # FP8: no isfinite kernel
        tensor = tensor.to(torch.complex64 if tensor.is_complex() else torch.float32)
    return torch.isfinite(tensor).all()


def first_nonfinite(state: Any, root: str = "state") -> tuple[str, torch.Tensor] | None:
    """The path (``state['model']['0.weight']``) and tensor of the first floating tensor
    in ``state`` holding an inf or NaN, in container order; None if every one is finite.

    Syncs once per device that holds floating tensors.
    """
    floating = [
        (path, t)
        for path, t in _leaves(state, root)
        if (t.is_floating_point() or t.is_complex()) and t.numel() > 0
    ]
    by_device: dict[torch.device, list[int]] = {}
    for index, (_, tensor) in enumerate(floating):
        by_device.setdefault(tensor.device, []).append(index)
    bad: list[int] = []
    with torch.no_grad():
        for indices in by_device.values():
            flags = torch.stack([_all_finite(floating[i][1]) for i in indices]).tolist()
            bad.extend(i for i, ok in zip(indices, flags, strict=True) if not ok)
    if not bad:
        return None
    return floating[min(bad)]


def nonfinite_message(path: str, tensor: torch.Tensor) -> str:
    """What is wrong with ``tensor``: how many NaNs and infs, of how many elements."""
    values = tensor.coalesce().values() if tensor.is_sparse else tensor
    values = values.detach().to(torch.float32) if values.dtype.itemsize == 1 else values.detach()
    nans = int(torch.isnan(values).sum())
    infs = int(torch.isinf(values).sum())
    return (
        f"{path} holds {nans} NaN and {infs} inf value(s) of {values.numel()} "
        f"({values.dtype}, shape {tuple(values.shape)})"
    )
