"""What one rank of a distributed test does; each scenario returns the rank's results.

Run by ``dist_worker.py`` inside an initialised process group (gloo, CPU). Results are
plain tensors, numbers and lists, which the tests compare across ranks and with the
single-process control that rank 0 runs after the distributed part.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_models import (
    global_batch,
    local_rows,
    mean_over_ranks,
    mlp,
    sgd,
    single_process_run,
    train_steps,
)
from torch.nn.parallel import DistributedDataParallel as DDP

import amped
import amped.scaling.distributed as scaling_distributed
from amped._internal.torch_compat import tensor_use_count
from amped.checkpoint import load_checkpoint, save_checkpoint
from amped.scaling.distributed import check_scaler_agreement, gather_objects

INF_STEP, INF_STEPS = 2, 5
EQUIVALENCE_STEPS = 8
DDP_RECIPES = (
    "fp32",
    "bf16-mixed",
    "fp16-mixed",
    "bf16-master",
    "fp16-master",
    "bf16-pure",
    "bf16-pure-sr",
)
FSDP_RECIPES = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master")
CKPT_STEPS, CKPT_EVERY = 12, 4


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole and in float32 (gathered if sharded: a collective)."""
    out = {}
    for name, param in model.named_parameters():
        value = param.full_tensor() if hasattr(param, "full_tensor") else param
        out[name] = value.detach().float().clone()
    return out


class AllReduceCounter:
    """Counts ``dist.all_reduce`` calls (FSDP2 itself reduce-scatters; it never calls it)."""

    def __enter__(self) -> AllReduceCounter:
        self.calls, self._original = 0, dist.all_reduce

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return self._original(*args, **kwargs)

        dist.all_reduce = counted
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce = self._original


# --- 1. an inf on one rank only ------------------------------------------------------


def _inf_on_one_rank(model, forward, scaler, optimizer, rank: int, grad_of) -> dict[str, Any]:
    """Train; at INF_STEP, after backward (and DDP's all-reduce), rank 1 writes an inf
    into one element of its own gradient. Records what each rank did."""
    stepped, scales, before, after = [], [], {}, {}
    with AllReduceCounter() as counter:
        for step in range(INF_STEPS):
            x, y = global_batch(step)
            x, y = local_rows(x, rank, 2), local_rows(y, rank, 2)
            with amped.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(forward(x).float(), y)
            scaler.scale(loss).backward()
            if step == INF_STEP and rank == 1:
                grad_of(model)[0, 0] = math.inf
            if step == INF_STEP:
                before = {k: v.detach().clone() for k, v in model.state_dict().items()}
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            if step == INF_STEP:
                after = {k: v.detach().clone() for k, v in model.state_dict().items()}
            stepped.append(not scaler.last_step_skipped)
            scales.append(scaler.get_scale())
    unchanged = all(torch.equal(_local(before[k]), _local(after[k])) for k in before)
    return {
        "stepped": stepped,
        "scales": scales,
        "unchanged_at_inf_step": unchanged,
        "all_reduce_calls": counter.calls,
        "params": full_params(model),
    }


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _scaler(process_group: Any = None) -> amped.GradScaler:
    return amped.GradScaler(
        "cpu", init_scale=2.0**10, growth_interval=1000, process_group=process_group
    )


def inf_ddp(rank: int, agreed: bool = True) -> dict[str, Any]:
    model = mlp()
    ddp = DDP(model)
    scaler = _scaler(dist.group.WORLD if agreed else None)
    return _inf_on_one_rank(model, ddp, scaler, sgd(model), rank, lambda m: m[0].weight.grad)


def inf_fsdp(rank: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard  # 3 s to import: only where needed

    model = mlp()
    for layer in (model[0], model[3]):
        fully_shard(layer)
    fully_shard(model)
    # process_group left at None: the scaler finds the mesh from the DTensor gradients.
    return _inf_on_one_rank(
        model, model, _scaler(), sgd(model), rank, lambda m: m[0].weight.grad.to_local()
    )


# --- 2. two processes against one ----------------------------------------------------


def equivalence_ddp(rank: int, recipe: str) -> dict[str, Any]:
    model = mlp()
    setup = amped.prepare(model, sgd(model), recipe)
    # DDP wraps the model prepare() converted; the setup steps the (master) optimizer.
    record = train_steps(DDP(setup.model), setup, range(EQUIVALENCE_STEPS), rank, 2)
    return _with_control(rank, recipe, record, setup.fp32_state_dict())


def equivalence_fsdp(rank: int, recipe: str) -> dict[str, Any]:
    """amped's recipes on FSDP2: ``*-mixed`` keep float32 sharded weights under amped's
    autocast; ``*-master`` map onto FSDP2's MixedPrecisionPolicy (the float32 shards
    are the masters) with LayerNorm kept in float32, as amped's O2 keeps it."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = mlp()
    chosen = amped.recipes.registry.resolve_recipe(recipe)
    if chosen.weights == "low-with-masters":
        low = MixedPrecisionPolicy(param_dtype=chosen.dtype, reduce_dtype=torch.float32)
        # amped's per-module "fp32" rule, in FSDP2's terms: float32 parameters and inputs.
        fully_shard(model[2], mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32))
        for layer in (model[0], model[3]):
            fully_shard(layer, mp_policy=low)
        fully_shard(model, mp_policy=low)
    else:
        for layer in (model[0], model[3]):
            fully_shard(layer)
        fully_shard(model)
    mixed = recipe.replace("-master", "-mixed")
    setup = amped.prepare(model, sgd(model), mixed)  # the same loss scaling as `recipe`
    record = train_steps(model, setup, range(EQUIVALENCE_STEPS), rank, 2)
    return _with_control(rank, recipe, record, full_params(model))


def _with_control(rank: int, recipe: str, record: dict[str, Any], params) -> dict[str, Any]:
    record["losses"] = mean_over_ranks(record["losses"])
    record["params"] = params
    if rank == 0:
        record["control"] = single_process_run(recipe, EQUIVALENCE_STEPS)
    return record


# --- 3. checkpoints, and resuming after a rank dies ----------------------------------


def checkpointed(rank: int, options: Options) -> dict[str, Any]:
    """fp16-master under DDP, with overflows (so backoffs, and growth with
    ``growth_interval=2``); rank 0 saves ``OUT/checkpoint.pt`` every CKPT_EVERY steps,
    after checking that every rank's scaler agrees. With ``--slow``, sleeps after
    each step past the first checkpoint, so that a test can kill a rank mid-run."""
    return _train_with_checkpoints(rank, options.out / "checkpoint.pt", options.slow)


def resumed(rank: int, options: Options) -> dict[str, Any]:
    """:func:`checkpointed`, resumed from ``RESUME/checkpoint.pt`` (every rank reads it)."""
    path = options.resume / "checkpoint.pt" if options.resume else None
    if path is None or not path.exists():
        return {"missing": True}
    return _train_with_checkpoints(rank, path, slow=False)


def _train_with_checkpoints(rank: int, path: Path, slow: bool) -> dict[str, Any]:
    model = mlp()
    scaler = amped.GradScaler("cpu", init_scale=2.0**14, growth_interval=2, hysteresis=2)
    setup = amped.prepare(model, sgd(model), "fp16-master", scaler=scaler)
    ddp = DDP(setup.model)
    start = 0
    if path.exists():
        state = load_checkpoint(path)
        setup.load_state_dict(state["setup"])
        start = state["step"]
    record: dict[str, Any] = {"losses": [], "stepped": [], "scales": []}
    for step in range(start, CKPT_STEPS):
        part = train_steps(ddp, setup, range(step, step + 1), rank, 2)
        for key, values in part.items():
            record[key] += values
        if (step + 1) % CKPT_EVERY == 0:
            check_scaler_agreement(setup.scaler)  # collective: every rank calls it
            if rank == 0:  # atomic: a crash leaves the previous checkpoint whole
                save_checkpoint(path, setup=setup.state_dict(), step=step + 1)
            print(f"saved {step + 1}", flush=True)
        if slow and step + 1 >= CKPT_EVERY:
            time.sleep(0.2)
    record["losses"] = [loss.item() for loss in record["losses"]]
    record["params"] = setup.fp32_state_dict()
    record["start"] = start
    return record


# --- 4. gathering objects, and scalers that disagree ----------------------------------

GATHERS = 100


def gathered(rank: int, options: Options) -> dict[str, Any]:
    """gather_objects GATHERS times, rank 1's payload longer each time, recording whether
    gloo's worker had let go of the tensors when each returned (it still held them on
    about 1 return of the collective in 4, measured here); then check_scaler_agreement
    on scalers that differ."""
    original = scaling_distributed.wait_until_released
    waits: list[dict[str, bool]] = []

    def observed(
        tensors: list[torch.Tensor],
        counts: list[int],
        deadline_s: float = scaling_distributed.RELEASE_DEADLINE_S,
    ) -> bool:
        def back() -> bool:
            return all(tensor_use_count(t) == n for t, n in zip(tensors, counts, strict=True))

        released = original(tensors, counts, deadline_s)
        waits.append({"released": released, "back": back()})
        return released

    scaling_distributed.wait_until_released = observed
    try:
        objects = [gather_objects({"rank": rank, "pad": "x" * (i * rank)}) for i in range(GATHERS)]
    finally:
        scaling_distributed.wait_until_released = original
    scaler = amped.GradScaler("cpu", init_scale=2.0 ** (10 + rank))
    try:
        check_scaler_agreement(scaler)
        disagreement = None
    except RuntimeError as error:
        disagreement = str(error)
    return {"objects": objects, "waits": waits, "disagreement": disagreement}


@dataclasses.dataclass(frozen=True)
class Options:
    """The worker's command line: results directory, ``--slow``, ``--resume DIR``."""

    out: Path
    slow: bool = False
    resume: Path | None = None


SCENARIOS: dict[str, Callable[[int, Options], dict[str, Any]]] = {
    "inf_ddp": lambda rank, options: inf_ddp(rank),
    "inf_ddp_unagreed": lambda rank, options: inf_ddp(rank, agreed=False),
    "inf_fsdp": lambda rank, options: inf_fsdp(rank),
    **{f"ddp_{r}": lambda rank, options, r=r: equivalence_ddp(rank, r) for r in DDP_RECIPES},
    **{f"fsdp_{r}": lambda rank, options, r=r: equivalence_fsdp(rank, r) for r in FSDP_RECIPES},
    "checkpointed": checkpointed,
    "resumed": resumed,
    "gathered": gathered,
}
