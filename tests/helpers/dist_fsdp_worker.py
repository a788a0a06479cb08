"""The bf16-pure scenarios of one rank on FSDP2 (run by tests/helpers/dist_fsdp2_worker.py,
results read by tests/distributed/test_fsdp2_pure.py). :func:`scenarios` returns:

- ``equal/RECIPE``: the recipe on a ``fully_shard`` model, every rank on the same
  global batch, against (on one rank: ``control``) one process without FSDP2 on the
  same model, data and seed: parameters, the 8-bit moments (dequantized) and which state each
  parameter keeps.
- ``fused/RECIPE``: ``equal`` with the fused step on both sides (bf16-pure, -sr).
- ``dcp/RECIPE``: state and lowered weights saved with torch.distributed.checkpoint
  and loaded into a fresh setup, then both trained on.
- ``wire``: the bytes FSDP2 all-gathers in one training step, per recipe (the inputs
  of ``dist.all_gather_single``, which FSDP2's default all-gather calls).

(FP8 layers with uneven shards: tests/helpers/dist_fp8_wire_worker.py.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from dist_models import GatherCounter, clock, local_state, train_on, whole
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import amped

RECIPES = ("bf16-pure", "bf16-pure-sr", "bf16-pure-8bit")
STEPS = 3
BATCH, IN, OUT = 16, 64, 33


def net() -> nn.Sequential:
    """Rows chosen against the 8-bit state's blocks of 256 (amped.optim.sharded_state):
    0.weight is 68 x 64 (17 blocks; on 2 ranks 34 rows each, so rank 1 starts in the
    middle of block 8: a shared block), 3.weight 256 x 68 (68 blocks; 128 rows each,
    34 blocks), 9.weight 33 x 256 (33 rows: 17 and 16, uneven). 5.weight and 7.weight
    (2048 x 256, 256 x 2048, no biases between them) have shards larger than the eager
    step's chunks, so each is stepped in pieces, one after the other. The biases and
    the norm are below 4096 elements: float32 moments."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(IN, 68),
        nn.GELU(),
        nn.LayerNorm(68),
        nn.Linear(68, 256),
        nn.GELU(),
        nn.Linear(256, 2048, bias=False),
        nn.GELU(),
        nn.Linear(2048, 256, bias=False),
        nn.GELU(),
        nn.Linear(256, OUT),
    )


def shard(model: nn.Sequential) -> nn.Sequential:
    for index in (0, 3, 5, 7, 9):
        fully_shard(model[index])
    fully_shard(model)
    return model


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, IN, generator=generator), torch.randn(BATCH, OUT, generator=generator)


def prepared(recipe: str, sharded: bool, fused: bool | None = False) -> amped.TrainSetup:
    model = shard(net()) if sharded else net()
    setup = amped.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2), recipe)
    # Both runs take the same step (eager unless asked): the fused step agrees with the
    # eager one but for rare roundings (amped.optim.fused says which), and
    # bf16-pure-8bit's fused step is for plain parameters only.
    setup.optimizer.fused = fused
    return setup


def train(setup: amped.TrainSetup, steps: range, rank: int = 0, world: int = 1) -> list[float]:
    return train_on(setup, batch, steps, rank, world)


def record(setup: amped.TrainSetup) -> dict[str, Any]:
    """Whole parameters, their local shards' dtypes, each one's state keys and dtypes,
    and the 8-bit optimizer's moments (dequantized, whole)."""
    optimizer = setup.optimizer
    out: dict[str, Any] = {"params": {}, "local_dtype": {}, "state": {}, "moments": {}}
    for name, param in setup.model.named_parameters():
        out["params"][name] = whole(param)
        shard = param.to_local() if hasattr(param, "to_local") else param
        out["local_dtype"][name] = str(shard.dtype)
        state = optimizer.state[param]
        out["state"][name] = {k: str(v.dtype) for k, v in state.items() if torch.is_tensor(v)}
        if hasattr(optimizer, "moments"):
            out["moments"][name] = [whole(m) for m in optimizer.moments(param)]
    return out


def equal(recipe: str, rank: int, control_rank: int, fused: bool | None = False) -> dict[str, Any]:
    """The 2-rank run on every rank; the one-process control on ``control_rank`` only
    (the scenarios alternate it, so that the ranks run their controls side by side)."""
    setup = prepared(recipe, sharded=True, fused=fused)
    out = record_after(setup, train(setup, range(STEPS)))
    if rank == control_rank:
        control = prepared(recipe, sharded=False, fused=fused)
        out["control"] = record_after(control, train(control, range(STEPS)))
    return out


def record_after(setup: amped.TrainSetup, losses: list[float]) -> dict[str, Any]:
    out = record(setup)
    out["losses"] = losses
    out["memory"] = amped.memory_report(setup.model, setup.optimizer).as_dict()
    return out


def checkpointed(recipe: str, rank: int, world: int, folder: Path) -> dict[str, Any]:
    setup = prepared(recipe, sharded=True)
    train(setup, range(2), rank, world)
    model_state, optim_state = get_state_dict(setup.model, setup.optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(folder))
    saved = local_state(setup)
    after = train(setup, range(2, STEPS), rank, world)

    fresh = prepared(recipe, sharded=True)
    model_state, optim_state = get_state_dict(fresh.model, fresh.optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(
        fresh.model,
        fresh.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
    )
    loaded = local_state(fresh)
    resumed = train(fresh, range(2, STEPS), rank, world)
    return {
        "saved": saved,
        "loaded": loaded,
        "losses": after,
        "resumed_losses": resumed,
        "params": {n: whole(p) for n, p in setup.model.named_parameters()},
        "resumed_params": {n: whole(p) for n, p in fresh.model.named_parameters()},
    }


def wire(rank: int, world: int) -> dict[str, Any]:
    out = {}
    for recipe in ("bf16-mixed", "bf16-pure", "bf16-pure-8bit"):
        setup = prepared(recipe, sharded=True) if recipe != "bf16-mixed" else None
        if setup is None:
            model = shard(net())
            setup = amped.prepare(model, torch.optim.AdamW(model.parameters()), recipe)
        with GatherCounter() as counter:
            train(setup, range(1), rank, world)
        out[recipe] = {"bytes": counter.bytes, "dtypes": counter.dtypes}
    out["params"] = sum(p.numel() for p in net().parameters())
    return out


def scenarios(rank: int, world: int, out: Path) -> dict[str, Any]:
    """Every scenario of this module (see its docstring), by name."""
    results: dict[str, Any] = {}
    for index, recipe in enumerate(RECIPES):
        with clock(f"equal/{recipe}"):
            results[f"equal/{recipe}"] = equal(recipe, rank, control_rank=index % 2)
        with clock(f"dcp/{recipe}"):
            results[f"dcp/{recipe}"] = checkpointed(recipe, rank, world, out / f"dcp-{recipe}")
    for index, recipe in enumerate(("bf16-pure", "bf16-pure-sr")):  # fused, on shards too
        with clock(f"fused/{recipe}"):
            results[f"fused/{recipe}"] = equal(recipe, rank, 1 - index, fused=True)
    with clock("wire"):
        results["wire"] = wire(rank, world)
    return results
