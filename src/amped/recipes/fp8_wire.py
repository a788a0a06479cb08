"""Which layers of an FP8 recipe all-gather FP8 weights under FSDP2, installed by ``prepare``.

For each converted layer whose weight ``fully_shard`` sharded, ``prepare`` makes the
weight's local shard a :class:`~amped.fp8.fsdp_wire.WireShard` where one FP8 cast of
the weight serves every GEMM it enters, bit for bit as in one process
(``fp8-tensorwise``, ``fp8-delayed``): FSDP2 then all-gathers one byte per weight
element instead of two (bfloat16 shards) or four (float32 shards). The other recipes
keep all-gathering their weights in the shards' dtype, with a warning naming the layers
and the reason (docs/distributed.md):

- ``fp8-rowwise`` and ``fp8-rowwise-gw-hp``: the forward's rowwise cast is local to a
  row (a shard holds whole rows), but the grad-input GEMM casts the weight again by
  another rule (rowwise over the output dim: per input feature, an amax over every
  rank's rows; or tensorwise), from the high-precision weight the layer saves.
- ``mxfp8``, ``mxfp4``: the same for blocks of 32 along the input dim (forward) and the
  output dim (grad-input GEMM).
- ``nvfp4``: its 16x16 weight tiles serve both GEMMs, so an FP4 wire could be exact
  where the shard boundaries fall on multiples of 16 rows; not built (the block layer
  casts the saved high-precision weight again in its backward).
"""

from __future__ import annotations

import warnings

import torch

from amped._internal.errors import received
from amped._internal.torch_compat import (
    dtensor_local,
    fsdp_reset_sharded_params,
    set_dtensor_local,
)
from amped.fp8.block_linear import BlockLinear
from amped.fp8.convert import Fp8Layers
from amped.fp8.fsdp_wire import WireShard, wire_refusal
from amped.fp8.linear import Float8Linear
from amped.recipes.shards import fsdp_modules, is_sharded, reshard

__all__ = ["install_fp8_wire", "wire_layers"]

_BLOCKS = (
    "its block cast runs along the input features in the forward and along the output "
    "features in the grad-input GEMM, from the high-precision weight its backward saves"
)


_REPLACED = (
    "FSDP2 replaced its local shard when taking it up (CPUOffloadPolicy pins a copy), "
    "dropping the all-gather hooks"
)


def _refusal(layer: Float8Linear | BlockLinear) -> str | None:
    """Why ``layer``'s sharded weight keeps its own dtype on the wire, or None."""
    placements = tuple(layer.weight.placements)  # type: ignore[attr-defined]
    if len(placements) != 1 or not placements[0].is_shard() or placements[0].dim != 0:
        return f"its weight is not sharded on dim 0 over a 1-D mesh ({placements})"
    if isinstance(layer, BlockLinear):
        return _BLOCKS
    return wire_refusal(layer.fp8_config)


def wire_layers(model: torch.nn.Module) -> list[str]:
    """The names of ``model``'s modules whose weight all-gathers in FP8 now."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, Float8Linear)
        and is_sharded(module.weight)
        and isinstance(dtensor_local(module.weight), WireShard)
    ]


@torch.no_grad()
def install_fp8_wire(model: torch.nn.Module, layers: Fp8Layers) -> dict[str, str]:
    """Have FSDP2 all-gather the sharded weights of ``layers`` in FP8 where that is exact
    (see the module). Returns, by layer name, why each other sharded layer keeps its
    dtype on the wire (and warns with it); empty when nothing is sharded."""
    sharded = {n: m for n, m in layers.layers.items() if is_sharded(m.weight)}
    if not sharded:
        return {}
    reshard(model)  # the root keeps its unsharded weights after a forward
    kept = {}
    for name, layer in sharded.items():
        reason = _refusal(layer)
        if reason is not None:
            kept[name] = reason
            continue
        shard = dtensor_local(layer.weight)
        if not isinstance(shard, WireShard):  # the same storage: writes still reach it
            set_dtensor_local(layer.weight, shard.as_subclass(WireShard))
    for module in fsdp_modules(model):
        fsdp_reset_sharded_params(module)
    for name, layer in sharded.items():  # FSDP2 may replace a local tensor it takes up
        if name not in kept and not isinstance(dtensor_local(layer.weight), WireShard):
            kept[name] = _REPLACED
    if kept:
        reasons = sorted(set(kept.values()))
        warnings.warn(
            f"FSDP2 all-gathers the weights of {len(kept)} FP8 layer(s) in their own dtype, "
            f"not FP8: {'; '.join(reasons)} (docs/distributed.md, 'FP8 on the wire'). "
            + received("layers", sorted(kept)),
            UserWarning,
            stacklevel=4,
        )
    return kept
