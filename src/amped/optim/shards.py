"""Where an FSDP2 shard lies in its parameter: the optimizers step local shards only.

``fully_shard`` keeps each parameter as a DTensor sharded on dim 0 over a 1-D mesh:
rank ``r`` holds rows ``r * R`` to ``(r + 1) * R`` (``R = ceil(rows / world)``, the
last ranks fewer or none), as ``torch.chunk`` cuts them. The bf16-pure optimizers
step the local rows (:func:`local`) and number what must not depend on the mesh (the
stochastic rounding's random bits, the 8-bit state's blocks) by each element's place
in the *unsharded* parameter, flattened: :func:`flat_start` is where the local rows
begin there. A plain tensor is its own shard, starting at 0.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from amped._internal.errors import value_error
from amped._internal.torch_compat import dtensor_class

__all__ = [
    "check_placements",
    "flat_start",
    "fsdp_modules",
    "is_sharded",
    "local",
    "rebuild",
    "reshard",
    "with_random_state",
    "without_random_state",
]


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (FSDP2's parameters, their gradients and state)."""
    dtensor = dtensor_class()
    return dtensor is not None and isinstance(tensor, dtensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (its own memory, not a copy: writes reach the
    DTensor), or ``tensor`` itself. Call under ``torch.no_grad()``."""
    return tensor.to_local() if is_sharded(tensor) else tensor  # type: ignore[attr-defined]


def fsdp_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` that ``fully_shard`` sharded (none if FSDP2 is not loaded:
    it is looked up, never imported)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    kind = getattr(fsdp, "FSDPModule", None)
    return [] if kind is None else [m for m in model.modules() if isinstance(m, kind)]


def reshard(model: torch.nn.Module) -> None:
    """Register the sharded parameters of every ``fully_shard`` module of ``model`` (the
    root keeps the unsharded ones after a forward, until its backward)."""
    for module in fsdp_modules(model):
        module.reshard()  # type: ignore[operator]


def check_placements(name: str, param: torch.Tensor) -> None:
    """Refuse a DTensor that is not sharded as ``fully_shard`` shards: dim 0, 1-D mesh."""
    placements = tuple(param.placements)  # type: ignore[attr-defined]
    shard = placements[0] if len(placements) == 1 else None
    if shard is None or not shard.is_shard() or shard.dim != 0:
        raise value_error(
            "The bf16-pure recipes step FSDP2 shards: parameters sharded on dim 0 over a "
            "1-D device mesh (fully_shard's default). Shard with fully_shard(module) and "
            "no shard_placement_fn, on a 1-D mesh (no HSDP, no tensor parallel)",
            f"{name}.placements",
            placements,
        )


def flat_start(tensor: torch.Tensor) -> int:
    """Where ``tensor``'s local shard starts in the unsharded tensor, flattened (0 for a
    plain tensor)."""
    if not is_sharded(tensor):
        return 0
    mesh: Any = tensor.device_mesh  # type: ignore[attr-defined]
    rows = tensor.shape[0]
    per_rank = -(-rows // mesh.size())
    first_row = min(mesh.get_local_rank() * per_rank, rows)
    return first_row * (tensor.numel() // rows if rows else 0)


def rebuild(like: torch.Tensor, local_tensor: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A DTensor of global ``shape`` over ``local_tensor`` (no copy), on ``like``'s mesh
    and placements (a DTensor)."""
    dtensor: Any = type(like)
    contiguous = torch.empty(shape, device="meta").stride()
    return dtensor.from_local(
        local_tensor,
        like.device_mesh,  # type: ignore[attr-defined]
        like.placements,  # type: ignore[attr-defined]
        run_check=False,
        shape=shape,
        stride=contiguous,
    )


# torch.distributed.checkpoint keeps an optimizer's "state" and "param_groups" only, so
# the compensated optimizers' random stream (seed and generator state, top-level keys of
# their state_dict) also travels in the first parameter group, where DCP keeps it.
_RANDOM_KEYS = ("seed", "rng_state")


def with_random_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with its top-level seed and generator state also in its first
    parameter group (the same objects: nothing is copied)."""
    groups = state_dict["param_groups"]
    if groups:
        first = dict(groups[0])
        first.update({key: state_dict[key] for key in _RANDOM_KEYS if key in state_dict})
        state_dict["param_groups"] = [first, *groups[1:]]
    return state_dict


def without_random_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``state_dict`` with the seed and generator state at the top level only
    (found there, or in the first parameter group of a DCP-loaded one)."""
    out = dict(state_dict)
    groups = [dict(group) for group in state_dict.get("param_groups", [])]
    for group in groups:
        for key in _RANDOM_KEYS:
            value = group.pop(key, None)
            if value is not None:
                out.setdefault(key, value)
    out["param_groups"] = groups
    return out
