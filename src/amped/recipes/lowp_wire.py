"""Which layers of an FP8 or block recipe all-gather low-precision weights under FSDP2.

Installed by ``prepare``.

For each converted layer whose weight ``fully_shard`` sharded, ``prepare`` makes the
weight's local shard a :class:`~amped.lowp.float8.fsdp_wire.WireShard` where one FP8 cast of
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

``nvfp4`` layers all-gather FP4 (:class:`~amped.lowp.mx.fsdp_block_wire.BlockWireShard`):
its 16x16 weight tiles serve both GEMMs, exactly where the weight's rows split evenly
into shards of whole tiles; other shapes keep their dtype, with the warning.
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
from amped.lowp.convert import LowPrecisionLayers
from amped.lowp.float8.fsdp_wire import WireShard, wire_refusal
from amped.lowp.float8.linear import Float8Linear
from amped.lowp.mx.block_linear import BlockLinear
from amped.lowp.mx.fsdp_block_wire import BlockWireShard, block_wire_refusal
from amped.optim.shards import fsdp_modules, is_sharded, reshard

__all__ = ["install_low_precision_wire", "wire_layers"]

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
        world = layer.weight.device_mesh.size()  # type: ignore[attr-defined]
        rows = layer.weight.shape[0]
        return block_wire_refusal(layer.block_config, rows, world, layer.weight_transposed)
    return wire_refusal(layer.float8_config)


def _wire_class(layer: Float8Linear | BlockLinear) -> type[torch.Tensor]:
    return BlockWireShard if isinstance(layer, BlockLinear) else WireShard


def wire_layers(model: torch.nn.Module) -> list[str]:
    """The names of ``model``'s modules whose weight all-gathers in FP8 now."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, (Float8Linear, BlockLinear))
        and is_sharded(module.weight)
        and isinstance(dtensor_local(module.weight), _wire_class(module))
    ]


@torch.no_grad()
def install_low_precision_wire(
    model: torch.nn.Module, layers: LowPrecisionLayers
) -> dict[str, str]:
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
        shard, wire = dtensor_local(layer.weight), _wire_class(layer)
        if not isinstance(shard, wire):  # the same storage: writes still reach it
            set_dtensor_local(layer.weight, shard.as_subclass(wire))
    for module in fsdp_modules(model):
        fsdp_reset_sharded_params(module)
    for name, layer in sharded.items():  # FSDP2 may replace a local tensor it takes up
        if name not in kept and not isinstance(dtensor_local(layer.weight), _wire_class(layer)):
            kept[name] = _REPLACED
    if kept:
        reasons = sorted(set(kept.values()))
        warnings.warn(
            f"FSDP2 all-gathers the weights of {len(kept)} low-precision layer(s) in their "
            f"own dtype, not FP8 or FP4: {'; '.join(reasons)} "
            "(docs/distributed.md, 'FP8 on the wire'). " + received("layers", sorted(kept)),
            UserWarning,
            stacklevel=4,
        )
    return kept
