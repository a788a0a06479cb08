"""The model, data and training loops the distributed tests run, on one rank or many.

Every rank builds the same model from the same seed and cuts its rows out of the
same global batch, so a run on N ranks and a run in one process see the same data.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import amped

GLOBAL_BATCH = 16
FEATURES = 8
# Loss-scaling recipes see a poisoned sample at this step. It lies in the last rank's
# rows, so under DDP only that rank computes the inf (and DDP's all-reduce spreads it).
POISON_STEP = 3
POISON_ROW = GLOBAL_BATCH - 1


def mlp(seed: int = 0) -> nn.Sequential:
    """Linear, GELU, LayerNorm (kept in float32 by O2), Linear."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))


def global_batch(step: int, poison: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step``, the same in every run and on every rank."""
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, FEATURES, generator=generator)
    y = torch.stack([x[:, :4].sum(1).sin(), x[:, 4:].prod(1).tanh(), x[:, 0], -x[:, 1]], 1)
    if poison and step == POISON_STEP:
        x[POISON_ROW, 0] = math.inf
    return x, y


def local_rows(tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return tensor.chunk(world)[rank]


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def train_steps(
    forward: nn.Module,
    setup: amped.TrainSetup,
    steps: range,
    rank: int = 0,
    world: int = 1,
) -> dict[str, list[Any]]:
    """Run ``steps`` through ``forward`` (the DDP wrapper, or the model) and ``setup``.

    Returns this rank's losses (on its rows), whether each step stepped, and the scale.
    """
    poison = setup.recipe.loss_scaling
    losses, stepped, scales = [], [], []
    for step in steps:
        x, y = global_batch(step, poison)
        x, y = local_rows(x, rank, world), local_rows(y, rank, world)
        with setup.autocast():
            loss = F.mse_loss(forward(x).float(), y)
        setup.backward(loss)
        stepped.append(setup.step())
        setup.zero_grad()
        losses.append(loss.detach().float())
        scales.append(setup.scaler.get_scale())
    return {"losses": losses, "stepped": stepped, "scales": scales}


def mean_over_ranks(values: list[torch.Tensor]) -> list[float]:
    """Per step, the mean over ranks of a per-rank value (the global batch's mean loss)."""
    stacked = torch.stack(values)
    dist.all_reduce(stacked)
    return (stacked / dist.get_world_size()).tolist()


def single_process_run(recipe: str, steps: int) -> dict[str, Any]:
    """The control: the same recipe in one process, on the whole global batch."""
    model = mlp()
    setup = amped.prepare(model, sgd(model), recipe)
    record = train_steps(setup.model, setup, range(steps))
    record["losses"] = [loss.item() for loss in record["losses"]]
    record["params"] = setup.fp32_state_dict()
    return record


# --- helpers of the FSDP2 workers (tests/helpers/dist_fsdp_worker.py, dist_fp8_wire_worker.py) ---

Batch = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


def train_on(
    setup: amped.TrainSetup, batch: Batch, steps: range, rank: int = 0, world: int = 1
) -> list[float]:
    """``steps`` steps of ``setup`` on rows ``rank`` of ``world`` of each ``batch(step)``
    (mean squared error); returns the losses."""
    losses = []
    for step in steps:
        x, y = batch(step)
        x, y = local_rows(x, rank, world), local_rows(y, rank, world)
        with setup.autocast():
            loss = F.mse_loss(setup.model(x).float(), y)
        setup.backward(loss)
        setup.step()
        setup.zero_grad()
        losses.append(loss.item())
    return losses


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor``, all-gathered if it is a DTensor (a collective then)."""
    value = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return value.detach().clone()


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


class GatherCounter:
    """Records ``(bytes, dtype)`` of each ``dist.all_gather_single`` input while active
    (FSDP2's default all-gather calls it once per group and all-gather)."""

    def __enter__(self) -> GatherCounter:
        self.calls: list[tuple[int, str]] = []
        self._original = dist.all_gather_single

        def counted(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.calls.append((input.numel() * input.element_size(), str(input.dtype)))
            return self._original(output, input, *args, **kwargs)

        dist.all_gather_single = counted  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_gather_single = self._original  # type: ignore[assignment]

    @property
    def bytes(self) -> int:
        return sum(b for b, _ in self.calls)

    @property
    def dtypes(self) -> list[str]:
        return sorted({d for _, d in self.calls})


class clock:
    """Prints ``name``, this process's CPU seconds and the wall seconds of the block to
    stdout (the rank's log: where a 2-rank test spends its time)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        self.cpu, self.wall = time.process_time(), time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        cpu, wall = time.process_time() - self.cpu, time.perf_counter() - self.wall
        print(f"{self.name}: {cpu:.2f} s CPU, {wall:.2f} s wall", flush=True)
