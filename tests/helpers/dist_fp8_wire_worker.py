"""The FP8- and FP4-on-the-wire scenarios of one rank (run by tests/helpers/dist_fsdp2_worker.py,
results read by tests/distributed/test_fp8_distributed.py). :func:`scenarios` returns:

- ``equal/RECIPE/BASE``: the FP8 recipe on a ``fully_shard`` model whose weights have
  33, 50 and 1 rows (17/16, 25/25 and 1/0 on 2 ranks), every rank on the same global
  batch, against one process (on every rank) without FSDP2: parameters, losses, delayed
  scaling's buffers, which layers all-gathered FP8, and (``wire``) the bytes and dtype
  of each ``dist.all_gather_single`` input in its second step.
- ``wire/RECIPE``: the same for ``bf16-pure`` and ``bf16-mixed`` (the bf16 and float32
  wires) on the same model.
- ``dcp/RECIPE``: weights and optimizer state saved with torch.distributed.checkpoint
  after 2 steps, loaded into a fresh setup, then both trained on.
- ``rowwise``, ``blockwise``: ``fp8-rowwise`` and ``fp8-blockwise`` on FSDP2: the
  warning ``prepare`` gives, the wire's dtype, and the parameters against one process.
- ``split/RECIPE``: each rank on its half of the batch, with the FP8 wire and with it
  taken away (the control).
- ``mixed``: ``fp8-tensorwise`` on float32 shards all-gathered as bfloat16 by a
  ``MixedPrecisionPolicy``, with the FP8 wire and with it taken away (the control).
- ``nvfp4``: nvfp4 on layers of 64, 32 and 48 rows against one process, and the bytes
  of its second step against the same model without the wire.
- ``plan``: a tuned per-layer plan (fp8-tensorwise, nvfp4, fp8-rowwise) converted
  before ``fully_shard``, against one process.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from dist_models import GatherCounter, clock, local_state, train_on, whole
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import amped
from amped._internal.torch_compat import (
    dtensor_local,
    fsdp_reset_sharded_params,
    set_dtensor_local,
)
from amped.lowp.convert import convert_layers
from amped.lowp.float8.config import FLOAT8_CONFIGS
from amped.lowp.mx.block_config import BLOCK_CONFIGS
from amped.optim.shards import fsdp_modules
from amped.recipes.lowp_wire import wire_layers
from amped.recipes.plan import PrecisionPlan

STEPS = 3
BATCH, IN = 16, 64
LINEARS = ("0", "3", "5")


def net() -> nn.Sequential:
    """Linear layers of 33, 50 and 1 output rows: uneven shards on 2 ranks, the last one
    empty on rank 1. No biases on them, so each layer's all-gather is its weight alone."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(IN, 33, bias=False),
        nn.GELU(),
        nn.LayerNorm(33),
        nn.Linear(33, 50, bias=False),
        nn.GELU(),
        nn.Linear(50, 1, bias=False),
    )


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, IN, generator=generator), torch.randn(BATCH, 1, generator=generator)


def prepared(recipe: str, base: str, sharded: bool) -> amped.TrainSetup:
    """``recipe`` on ``base``; under FSDP2 the Linear layers are converted first, then
    each one and the root ``fully_shard``ed."""
    model = net()
    if sharded:
        if recipe.startswith("fp8-"):
            config = FLOAT8_CONFIGS[recipe.removeprefix("fp8-")]
            convert_layers(model, config, list(LINEARS))
        for name in LINEARS:
            fully_shard(model.get_submodule(name))
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if not recipe.startswith("fp8-"):
        return amped.prepare(model, optimizer, recipe)
    setup = amped.prepare(model, optimizer, recipe, base=base, module_filter=lambda m, n: True)
    if hasattr(setup.optimizer, "fused"):
        setup.optimizer.fused = False  # the eager step on both sides
    return setup


def train(setup: amped.TrainSetup, steps: range, rank: int = 0, world: int = 1) -> list[float]:
    return train_on(setup, batch, steps, rank, world)


def record(setup: amped.TrainSetup, losses: list[float]) -> dict[str, Any]:
    model = setup.model
    return {
        "losses": losses,
        "params": {n: whole(p) for n, p in model.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
        "wire_layers": wire_layers(model),
    }


def equal(recipe: str, base: str) -> dict[str, Any]:
    setup = prepared(recipe, base, sharded=True)
    losses = train(setup, range(1))  # the first step sets FSDP2 up; count the second
    with GatherCounter() as counter:
        losses += train(setup, range(1, 2))
    out = record(setup, losses + train(setup, range(2, STEPS)))
    out["wire"] = counter.calls
    out["rows"] = {n: p.to_local().shape[0] for n, p in setup.model.named_parameters()}
    # Every rank runs the control: delayed scaling's first step all-reduces its amaxes
    # whenever a process group is up, sharded or not.
    control = prepared(recipe, base, sharded=False)
    out["control"] = record(control, train(control, range(STEPS)))
    return out


def wire(recipe: str, base: str) -> list[tuple[int, str]]:
    setup = prepared(recipe, base, sharded=True)
    train(setup, range(1))  # the first step sets FSDP2 up; count the second
    with GatherCounter() as counter:
        train(setup, range(1, 2))
    return counter.calls


def checkpointed(recipe: str, base: str, folder: Path) -> dict[str, Any]:
    setup = prepared(recipe, base, sharded=True)
    train(setup, range(2))
    model_state, optim_state = get_state_dict(setup.model, setup.optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(folder))
    saved = local_state(setup)
    after = train(setup, range(2, STEPS))

    fresh = prepared(recipe, base, sharded=True)
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
    with GatherCounter() as counter:
        resumed = train(fresh, range(2, STEPS))
    return {
        "saved": saved,
        "loaded": loaded,
        "losses": after,
        "resumed_losses": resumed,
        "params": {n: whole(p) for n, p in setup.model.named_parameters()},
        "resumed_params": {n: whole(p) for n, p in fresh.model.named_parameters()},
        "resumed_wire": counter.calls,
        "wire_layers": wire_layers(fresh.model),
    }


def without_wire(model: nn.Module) -> None:
    """Give each sharded weight a plain local tensor again (the same storage), so that
    FSDP2 all-gathers it in its own dtype: the control of the ``mixed`` scenario."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if weight is not None and hasattr(weight, "to_local"):
            local = dtensor_local(weight)
            set_dtensor_local(weight, local.as_subclass(torch.Tensor))
    for module in fsdp_modules(model):
        fsdp_reset_sharded_params(module)


def mixed(wire: bool) -> dict[str, Any]:
    """fp8-tensorwise on float32 shards that FSDP2 all-gathers as bfloat16
    (``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``): with the FP8 wire, and, as the
    control, all-gathering bfloat16 and casting the gathered weight in the layer."""
    model = net()
    convert_layers(model, FLOAT8_CONFIGS["tensorwise"], list(LINEARS))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for name in LINEARS:
        fully_shard(model.get_submodule(name), mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    setup = amped.prepare(model, optimizer, "fp8-tensorwise", module_filter=lambda m, n: True)
    if not wire:
        without_wire(model)
    with GatherCounter() as counter:
        out = record(setup, train(setup, range(STEPS)))
    out["wire"] = counter.calls
    return out


def split(recipe: str, rank: int, world: int) -> dict[str, Any]:
    """Each rank on its half of the batch (FSDP2 then sums the ranks' gradients, which
    one process never rounds apart): the FP8 wire against the same run with the wire
    taken off."""
    out = {}
    for wire in (True, False):
        setup = prepared(recipe, "bf16-pure", sharded=True)
        if not wire:
            without_wire(setup.model)
        out["wire" if wire else "control"] = record(setup, train(setup, range(STEPS), rank, world))
    return out


def kept_dtype(recipe: str) -> dict[str, Any]:
    """A recipe whose weights keep their dtype on the wire (``fp8-rowwise``,
    ``fp8-blockwise``): the warning, the wire's bytes, and one process's training."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        setup = prepared(recipe, "bf16-pure", sharded=True)
    with GatherCounter() as counter:
        out = record(setup, train(setup, range(STEPS)))
    out["warnings"] = [str(w.message) for w in caught if w.category is UserWarning]
    out["wire"] = counter.calls
    control = prepared(recipe, "bf16-pure", sharded=False)
    out["control"] = record(control, train(control, range(STEPS)))
    return out


FP8 = ("fp8-tensorwise", "fp8-delayed")
BLOCK_LINEARS = ("0", "2", "4")


def block_net() -> nn.Sequential:
    """nvfp4 layers (dims multiples of 16) of 64, 32 and 48 rows: on 2 ranks 32 and 16
    rows each (whole 16-row tiles: the FP4 wire), and 24 each (tiles cut: refused)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(IN, 64, bias=False),
        nn.GELU(),
        nn.Linear(64, 32, bias=False),
        nn.GELU(),
        nn.Linear(32, 48, bias=False),
    )


def block_prepared(sharded: bool, policy: MixedPrecisionPolicy | None = None) -> amped.TrainSetup:
    """nvfp4 on bf16-pure, every layer converted (named: nvfp4 keeps its last 15% in
    bfloat16 otherwise) before ``fully_shard``."""
    model = block_net()
    convert_layers(model, BLOCK_CONFIGS["nvfp4"], list(BLOCK_LINEARS))
    if sharded:
        kwargs = {} if policy is None else {"mp_policy": policy}
        for name in BLOCK_LINEARS:
            fully_shard(model.get_submodule(name), **kwargs)
        fully_shard(model, **kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    base = "bf16-pure" if policy is None else "bf16-mixed"
    setup = amped.prepare(model, optimizer, "nvfp4", base=base, module_filter=lambda m, n: True)
    if hasattr(setup.optimizer, "fused"):
        setup.optimizer.fused = False
    return setup


PLAN = PrecisionPlan("bf16-pure", {"0": "fp8-tensorwise", "2": "nvfp4", "4": "fp8-rowwise"})


def plan_prepared(sharded: bool) -> amped.TrainSetup:
    """A tuned per-layer plan on ``block_net``: under FSDP2 ``plan.convert`` first."""
    model = block_net()
    if sharded:
        PLAN.convert(model)
        for name in BLOCK_LINEARS:
            fully_shard(model.get_submodule(name))
        fully_shard(model)
    setup = amped.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2), PLAN)
    setup.optimizer.fused = False
    return setup


def plan() -> dict[str, Any]:
    """The plan's FP8 and NVFP4 layers on the wire (its rowwise one refused) against one
    process."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        setup = plan_prepared(sharded=True)
    with GatherCounter() as counter:
        out = record(setup, block_train(setup, range(STEPS)))
    out["wire"] = counter.calls
    out["warnings"] = [str(w.message) for w in caught if "FSDP2 all-gathers" in str(w.message)]
    control = plan_prepared(sharded=False)
    out["control"] = record(control, block_train(control, range(STEPS)))
    return out


def block_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, IN, generator=generator), torch.randn(BATCH, 48, generator=generator)


def block_train(setup: amped.TrainSetup, steps: range) -> list[float]:
    return train_on(setup, block_batch, steps)


def nvfp4() -> dict[str, Any]:
    """nvfp4 with the FP4 wire against one process; the bytes of its second step
    against bf16-pure's on the same model (the wire taken off)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        setup = block_prepared(sharded=True)
    losses = block_train(setup, range(1))  # the first step sets FSDP2 up; count the second
    with GatherCounter() as counter:
        losses += block_train(setup, range(1, 2))
    out = record(setup, losses + block_train(setup, range(2, STEPS)))
    out["wire"] = counter.calls
    out["warnings"] = [str(w.message) for w in caught if "FSDP2 all-gathers" in str(w.message)]
    out["rows"] = {n: p.to_local().shape[0] for n, p in setup.model.named_parameters()}
    plain = block_prepared(sharded=True)
    without_wire(plain.model)
    block_train(plain, range(1))
    with GatherCounter() as counter:
        block_train(plain, range(1, 2))
    out["plain_wire"] = counter.calls
    control = block_prepared(sharded=False)
    out["control"] = record(control, block_train(control, range(STEPS)))
    return out


def scenarios(rank: int, world: int, out: Path) -> dict[str, Any]:
    """Every scenario of this module (see its docstring), by name."""
    results: dict[str, Any] = {}
    for recipe in FP8:
        for base in ("bf16-pure", "bf16-mixed"):
            with clock(f"equal/{recipe}/{base}"):
                results[f"equal/{recipe}/{base}"] = equal(recipe, base)
        with clock(f"dcp/{recipe}"):
            results[f"dcp/{recipe}"] = checkpointed(recipe, "bf16-pure", out / f"dcp-{recipe}")
    for recipe in ("bf16-pure", "bf16-mixed"):
        with clock(f"wire/{recipe}"):
            results[f"wire/{recipe}"] = wire(recipe, "bf16-pure")
    for recipe in ("fp8-rowwise", "fp8-blockwise"):
        name = recipe.removeprefix("fp8-")
        with clock(name):
            results[name] = kept_dtype(recipe)
    with clock("mixed"):
        results["mixed"] = {"wire": mixed(wire=True), "control": mixed(wire=False)}
    for recipe in FP8:
        with clock(f"split/{recipe}"):
            results[f"split/{recipe}"] = split(recipe, rank, world)
    with clock("nvfp4"):
        results["nvfp4"] = nvfp4()
    with clock("plan"):
        results["plan"] = plan()
    return results
