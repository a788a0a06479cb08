"""Agreement across ranks: every rank skips the same steps and moves the scale alike.

Each rank unscales the gradients it holds and flags inf/NaN in them. When ranks hold
different gradients, one rank can flag an overflow that the others do not see; if it
alone skipped the step, the replicas would diverge silently. So the flag of the step
is all-reduced with ``MAX`` before anything reads it: one collective per optimizer step,
on the device, on top of the scaler's one host sync (with NCCL the collective is queued
on the stream and the sync that follows waits for it; gloo's runs on the host).

Which process group the flag is reduced over (``GradScaler(process_group=...)``)::

    None (default): detect.
        gradients are DTensors (FSDP2's fully_shard, tensor parallel):
            the group of each mesh dimension the gradients are not replicated over
            (one group for FSDP2, and for HSDP's shard dimension)
        plain tensors (one process, DDP): no collective. DDP all-reduces the
            gradients themselves, and an inf or NaN on any rank survives that sum,
            so every rank already sees it (torch.amp.GradScaler adds none either).
    a ProcessGroup (e.g. torch.distributed.group.WORLD): always that group, once.
        For sharding the scaler cannot see (ZeRO-style optimizers, pipeline stages),
        or gradients changed after DDP's all-reduce.

DTensor gradients are unscaled through their local shards. (Recent torch also reduces
the flag inside DTensor's dispatch of the check, once per dtype group of gradients;
checking the shards leaves one collective per step, and no reliance on that handler.)

Example:
    >>> import amped
    >>> from amped.scaling.distributed import agreement_groups
    >>> scaler = amped.GradScaler("cpu")  # process_group=None: detect
    >>> agreement_groups(None, [])  # one process: nothing to agree with
    []
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from amped._internal.errors import type_error
from amped._internal.torch_compat import (
    dtensor_class,
    process_group_device_types,
    tensor_use_count,
)
from amped.scaling.unscale import combine_on

__all__ = [
    "agree_across_ranks",
    "agree_found_inf_",
    "agreement_groups",
    "check_process_group",
    "check_scaler_agreement",
    "gather_objects",
    "wait_until_released",
]

# How long gather_objects waits for gloo's workers to drop a finished collective's
# tensors (microseconds, normally); it matters only for a broken process group.
RELEASE_DEADLINE_S = 5.0


def check_process_group(value: object) -> Any:
    """``GradScaler(process_group=...)``: None (detect) or a ``ProcessGroup``."""
    if value is None:
        return None
    if not dist.is_available() or not isinstance(value, dist.ProcessGroup):
        raise type_error(
            "`process_group` must be None (agree across the ranks that shard the "
            "gradients, found from DTensor gradients) or a torch.distributed.ProcessGroup "
            "such as torch.distributed.group.WORLD",
            "process_group",
            value,
        )
    return value


def agreement_groups(process_group: Any, params: Iterable[torch.Tensor]) -> list[Any]:
    """The process groups to reduce the found-inf flag over, in the same order on every rank.

    Args:
        process_group: the scaler's setting (see the module docstring).
        params: the optimizer's parameters (their gradients are read, not changed).
    """
    if process_group is not None:
        return [process_group]
    dtensor = dtensor_class()
    if dtensor is None or not dist.is_available() or not dist.is_initialized():
        return []
    groups: list[Any] = []
    for param in params:
        grad = param.grad
        if not isinstance(grad, dtensor):
            continue
        mesh = grad.device_mesh
        for dim, placement in enumerate(grad.placements):
            if placement.is_replicate():
                continue
            group = mesh.get_group(dim)
            # Placements are global metadata, so every rank lists the same groups in
            # the same (parameter) order, as collectives need.
            if not any(group is seen for seen in groups):
                groups.append(group)
    return groups


def agree_found_inf_(found_inf: torch.Tensor, groups: list[Any]) -> torch.Tensor:
    """All-reduce ``found_inf`` (0-d float32, > 0 on overflow) with ``MAX`` over each group.

    In place. ``MAX`` rather than the ``SUM`` of torch's ShardedGradScaler: the agreed
    flag stays within the values one rank can produce, whatever the world size. No
    host sync of its own.
    """
    for group in groups:
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
    return found_inf


def agree_across_ranks(
    process_group: Any,
    optimizer: torch.optim.Optimizer,
    flags: dict[torch.device, torch.Tensor],
    device: torch.device,
) -> dict[torch.device, torch.Tensor]:
    """This rank's per-device inf/NaN ``flags`` for ``optimizer``, replaced by the one flag
    every rank agrees on (one all-reduce per group, usually one), so that they skip
    alike. No sync."""
    params = (p for group in optimizer.param_groups for p in group["params"])
    groups = agreement_groups(process_group, params)
    if not groups:
        return flags
    # Every rank must join the collective, even one with no gradients (whose step()
    # then raises its own error rather than leaving the others waiting).
    found = combine_on(device, list(flags.values()))
    agree_found_inf_(found, groups)
    return {device: found} if flags else flags


def check_scaler_agreement(scaler: Any, process_group: Any = None) -> dict[str, Any]:
    """Check that every rank's scaler holds the same state; return this rank's state dict.

    Call it where every rank calls it, e.g. before rank 0 saves a checkpoint, to catch
    replicas that skipped different steps. Collective (:func:`gather_objects`) and a host
    sync; meant for checkpoints, not every step. Safe to exit right after it.

    Args:
        scaler: an :class:`amped.GradScaler` (or torch's), after ``update()``.
        process_group: the ranks to compare (default: all).

    Raises:
        RuntimeError: some rank's scaler state differs from rank 0's (it names them).
    """
    state = scaler.state_dict()
    states = gather_objects(state, process_group)
    differ = [rank for rank, other in enumerate(states) if other != states[0]]
    if differ:
        raise RuntimeError(
            "The GradScaler state differs across ranks: they skipped different steps, so "
            "their parameters have diverged. Pass the process group that shards the "
            f"gradients as GradScaler(process_group=...). State on rank 0: {states[0]!r}; "
            f"differing ranks={differ}"
        )
    return state


def gather_objects(obj: Any, process_group: Any = None) -> list[Any]:
    """Every rank's ``obj``, in rank order: ``dist.all_gather_object``, safe at exit.

    gloo's worker thread drops its references to a collective's tensors just after the
    caller sees it finish; if that is the last reference to a tensor made in Python and
    the interpreter is shutting down, the process aborts (pytorch#190489; see
    docs/distributed.md). So this gather owns its tensors and returns only once the
    worker has let go of them (:func:`wait_until_released`).

    Two all-gathers (lengths, then pickled bytes padded to the longest), on the device
    the group's backend communicates on. Unpickling runs code, so gather only from ranks
    of your own job, as ``all_gather_object``.
    """
    group: Any = dist.group.WORLD if process_group is None else process_group
    # The rule of all_gather_object: the CPU if the group has a CPU backend (or none
    # yet), else its one device type (its current device, e.g. NCCL's GPU).
    kinds = process_group_device_types(group)
    device = torch.device("cpu" if not kinds or "cpu" in kinds else kinds[0])
    world = dist.get_world_size(group)
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    length = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    first = [length, *lengths]
    first_counts = [tensor_use_count(tensor) for tensor in first]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(size.item()) for size in lengths]
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload.to(device)
    gathered = [torch.empty_like(padded) for _ in range(world)]
    second = [padded, *gathered]
    second_counts = [tensor_use_count(tensor) for tensor in second]
    dist.all_gather(gathered, padded, group=group)
    objects = [
        pickle.loads(bytes(data[:size].tolist()))
        for data, size in zip(gathered, sizes, strict=True)
    ]
    if device.type == "cpu":  # gloo's worker threads; see above
        wait_until_released(first + second, first_counts + second_counts)
    return objects


def wait_until_released(
    tensors: list[torch.Tensor], counts: list[int], deadline_s: float = RELEASE_DEADLINE_S
) -> bool:
    """Wait until each tensor's use count is back down to its entry in ``counts`` (taken
    with :func:`~amped._internal.torch_compat.tensor_use_count` before the collective).

    Polls with short sleeps, which release the GIL, so that a worker thread waiting for
    it can finish. Returns True once every count is back, False if ``deadline_s``
    passed first (a worker stuck in a broken process group).
    """
    deadline = time.monotonic() + deadline_s
    while any(tensor_use_count(t) > count for t, count in zip(tensors, counts, strict=True)):
        if time.monotonic() > deadline:
            return False
        time.sleep(1e-4)
    return True
