"""Shared pieces of the GradScaler tests: a tiny model, poisoning, twin runs, a sync counter."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from amped.scaling import ScaleStrategy
from amped.scaling.strategies import GrowthFactors, ScaleState

# Soak test: SGD on a least-squares problem with a known optimum, learning rate decayed
# to zero. The poisoned run skips ~5% of its 1000 steps (and its scheduler skips with
# it), so it ends on the same optimum a little less settled. Stated bound: the two
# final losses within 1% of each other, and each within 1% of the closed-form optimum.
# Measured over four poison seeds: gap 0.03-0.08%, excess over the optimum 0.3-0.4%
# (the rest of minibatch noise), so the bound has a margin of about 10x and 2.5x.
SOAK_REL_LOSS_GAP = 1e-2

POISONS = ("loss_inf", "loss_nan", "grad_inf", "grad_nan")


def tiny_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def batch(step: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step``, the same in every run (a generator seeded by the step)."""
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(size, 8, generator=generator)
    y = x.sum(dim=1, keepdim=True).sin() + 0.1 * torch.randn(size, 1, generator=generator)
    return x, y


def poisoned_loss(loss: torch.Tensor, poison: str | None) -> torch.Tensor:
    if poison == "loss_inf":
        return loss * math.inf
    if poison == "loss_nan":
        return loss * math.nan
    return loss


def poison_grad(model: nn.Module, poison: str | None) -> None:
    """Put one inf or NaN into a single gradient element."""
    if poison in ("grad_inf", "grad_nan"):
        grad = next(model.parameters()).grad
        assert grad is not None
        grad.view(-1)[3] = math.inf if poison == "grad_inf" else math.nan


def make_optimizers(kind: str, model: nn.Module) -> list[torch.optim.Optimizer]:
    """One optimizer of ``kind``, or two (``kind`` ends in '+two') over halves of the model."""
    factories: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
        "sgd": lambda params: torch.optim.SGD(params, lr=2e-3, momentum=0.9),
        "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
        "adam_fused": lambda params: torch.optim.Adam(params, lr=1e-2, fused=True),
    }
    name, _, two = kind.partition("+")
    layers = list(model.children())
    if two:
        first = factories[name](layers[0].parameters())
        return [first, factories["sgd"](layers[2].parameters())]
    return [factories[name](model.parameters())]


@dataclasses.dataclass
class Trace:
    """What a run did: the scale after each update, each step's skip, the final params."""

    scales: list[float] = dataclasses.field(default_factory=list)
    stepped: list[tuple[bool, ...]] = dataclasses.field(default_factory=list)
    params: list[torch.Tensor] = dataclasses.field(default_factory=list)


def count_steps(optimizer: torch.optim.Optimizer, calls: list[int]) -> None:
    """Count calls of ``optimizer.step`` into ``calls[0]``."""
    original = optimizer.step

    def step(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    optimizer.step = step  # type: ignore[method-assign]


@contextlib.contextmanager
def count_host_syncs() -> Iterator[list[str]]:
    """Record every Python-level read of a tensor's value on the host.

    Patches the Tensor methods that copy a value to the host (``item``, ``tolist``,
    ``cpu``, ``numpy``, ``bool()``/``float()``/``int()``/``index``); on CUDA each is a
    host-device sync. Yields the list of method names called, in order.
    """
    names = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
    calls: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in names}

    def wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return original(self, *args, **kwargs)

        return counted

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


@dataclasses.dataclass(frozen=True)
class BackoffOnly(ScaleStrategy):
    """A strategy of a user's own: halve on every overflow, never grow, count overflows."""

    def counters(self) -> dict[str, int]:
        return {"overflows": 0}

    def update(self, state: ScaleState, found_inf: torch.Tensor, factors: GrowthFactors) -> None:
        overflow = found_inf > 0
        state.counters["overflows"].add_(overflow.int())
        state.scale.mul_(torch.where(overflow, 0.5, 1.0))
