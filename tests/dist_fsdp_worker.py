"""One rank of the FSDP2 bf16-pure tests (run by tests/test_fsdp2_pure.py through
dist_launch, with torchrun's environment). Saves ``OUT_DIR/rankR.pt``:

- ``equal/RECIPE``: the recipe on a ``fully_shard`` model, every rank on the same
  global batch, against (rank 0) one process without FSDP2 on the same model, data
  and seed: parameters, the 8-bit moments (dequantized) and which state each
  parameter keeps.
- ``split/RECIPE``: the same, each rank on its half of the batch.
- ``fused/RECIPE``: ``equal`` with the fused step on both sides (bf16-pure, -sr).
- ``dcp/RECIPE``: state and lowered weights saved with torch.distributed.checkpoint
  and loaded into a fresh setup, then both trained on.
- ``wire``: the bytes FSDP2 all-gathers in one training step, per recipe (the inputs
  of ``dist.all_gather_single``, which FSDP2's default all-gather calls).
- ``uneven/fp8-tensorwise``: an FP8 recipe (on bf16-pure) whose layers have an odd
  number of rows (33: 17 and 16 on 2 ranks), against one process.
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import amped
from amped.fp8 import FP8_CONFIGS, convert_to_fp8

RECIPES = ("bf16-pure", "bf16-pure-sr", "bf16-pure-8bit")
STEPS = 4
BATCH, IN, OUT = 16, 64, 33


def net() -> nn.Sequential:
    """Rows chosen against the 8-bit state's blocks of 256 (amped.recipes.sharded_state):
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
    # eager one but for rare roundings (amped.recipes.fused says which), and
    # bf16-pure-8bit's fused step is for plain parameters only.
    setup.optimizer.fused = fused
    return setup


def train(setup: amped.TrainSetup, steps: range, rank: int = 0, world: int = 1) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(step)
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        with setup.autocast():
            loss = F.mse_loss(setup.model(x).float(), y)
        setup.backward(loss)
        setup.step()
        setup.zero_grad()
        losses.append(loss.item())
    return losses


def whole(tensor: torch.Tensor) -> torch.Tensor:
    value = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return value.detach().clone()


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


def equal(
    recipe: str, rank: int, world: int, split: bool, fused: bool | None = False
) -> dict[str, Any]:
    setup = prepared(recipe, sharded=True, fused=fused)
    rows = (rank, world) if split else (0, 1)
    out = record_after(setup, train(setup, range(STEPS), *rows))
    if rank == 0:
        control = prepared(recipe, sharded=False, fused=fused)
        out["control"] = record_after(control, train(control, range(STEPS)))
    return out


def record_after(setup: amped.TrainSetup, losses: list[float]) -> dict[str, Any]:
    out = record(setup)
    out["losses"] = losses
    return out


def local_state(setup: amped.TrainSetup) -> dict[str, Any]:
    """Every local shard of the weights and of the optimizer's state tensors, and the
    step counts, by parameter name."""
    out = {}
    for name, param in setup.model.named_parameters():
        state = setup.optimizer.state[param]
        out[name] = {"weight": param.to_local().clone()}
        for key, value in state.items():
            out[name][key] = value.to_local().clone() if torch.is_tensor(value) else value
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


def fp8_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, 33), nn.GELU(), nn.Linear(33, OUT))


def fp8_setup(sharded: bool) -> amped.TrainSetup:
    """fp8-tensorwise on bf16-pure, both layers converted (33 rows: not a multiple of
    16, so named explicitly); under FSDP2 converted before fully_shard."""
    model = fp8_net()
    if sharded:
        convert_to_fp8(model, FP8_CONFIGS["tensorwise"], ["0", "2"])
        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    setup = amped.prepare(
        model, optimizer, "fp8-tensorwise", base="bf16-pure", module_filter=lambda m, n: True
    )
    setup.optimizer.fused = False
    return setup


def uneven_fp8(rank: int) -> dict[str, Any]:
    setup = fp8_setup(sharded=True)
    out = {"losses": train(setup, range(STEPS)), "rows": {}}
    out["params"] = {n: whole(p) for n, p in setup.model.named_parameters()}
    out["rows"] = {n: p.to_local().shape[0] for n, p in setup.model.named_parameters()}
    out["layers"] = setup.fp8_layers.names()
    if rank == 0:
        control = fp8_setup(sharded=False)
        train(control, range(STEPS))
        out["control"] = {n: whole(p) for n, p in control.model.named_parameters()}
    return out


class GatherCounter:
    """Counts the bytes and dtypes of ``dist.all_gather_single``'s inputs while active."""

    def __enter__(self) -> GatherCounter:
        self.bytes, self.dtypes, self._original = 0, set(), dist.all_gather_single

        def counted(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.bytes += input.numel() * input.element_size()
            self.dtypes.add(str(input.dtype))
            return self._original(output, input, *args, **kwargs)

        dist.all_gather_single = counted  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_gather_single = self._original  # type: ignore[assignment]


def wire(rank: int, world: int) -> dict[str, Any]:
    out = {}
    for recipe in ("bf16-mixed", "bf16-pure", "bf16-pure-8bit"):
        setup = prepared(recipe, sharded=True) if recipe != "bf16-mixed" else None
        if setup is None:
            model = shard(net())
            setup = amped.prepare(model, torch.optim.AdamW(model.parameters()), recipe)
        with GatherCounter() as counter:
            train(setup, range(1), rank, world)
        out[recipe] = {"bytes": counter.bytes, "dtypes": sorted(counter.dtypes)}
    setup = fp8_setup(sharded=True)
    with GatherCounter() as counter:
        train(setup, range(1), rank, world)
    out["fp8-tensorwise"] = {"bytes": counter.bytes, "dtypes": sorted(counter.dtypes)}
    out["params"] = sum(p.numel() for p in net().parameters())
    out["fp8_params"] = sum(p.numel() for p in fp8_net().parameters())
    return out


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=float(os.environ["AMPED_COLLECTIVE_TIMEOUT_S"]))
    dist.init_process_group("gloo", timeout=timeout)
    try:
        results: dict[str, Any] = {}
        for recipe in RECIPES:
            results[f"equal/{recipe}"] = equal(recipe, rank, world, split=False)
            results[f"split/{recipe}"] = equal(recipe, rank, world, split=True)
            results[f"dcp/{recipe}"] = checkpointed(recipe, rank, world, out / f"dcp-{recipe}")
        for recipe in ("bf16-pure", "bf16-pure-sr"):  # the fused step, on shards too
            results[f"fused/{recipe}"] = equal(recipe, rank, world, split=False, fused=True)
        results["uneven/fp8-tensorwise"] = uneven_fp8(rank)
        results["wire"] = wire(rank, world)
        torch.save(results, out / f"rank{rank}.pt")
        # Every rank reaches this point before any tears its group down: a rank that
        # destroys its group while a peer's last collective is still in flight can
        # abort in gloo's teardown ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
