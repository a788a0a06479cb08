"""Verification: short paired training runs of the plan, bfloat16-mixed and the best
first/last-N rule (docs/tune.md, "How it verifies").

Each arm trains ``steps`` steps per seed; for one seed every arm starts from the same
weights and sees the same batches (the factory is called after
``torch.manual_seed(seed)``). An arm's final loss for a seed is the mean training loss
over its last ``max(1, steps // 10)`` steps; its gap is the mean over seeds of its final
loss minus bfloat16-mixed's. An arm passes when its gap is at most the budget and
every loss was finite.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from amped.lowp.attention_config import AttentionConfig
from amped.recipes import prepare
from amped.recipes.plan import PrecisionPlan
from amped.tasks.task import call_model
from amped.tuning.task import build_task

__all__ = ["Arm", "final_loss", "train_losses", "verify_arm"]

Progress = Callable[[str, int, int], None]


def final_loss(losses: list[float]) -> float:
    """The mean of the last ``max(1, len // 10)`` losses (inf if any is not finite)."""
    if not all(math.isfinite(v) for v in losses):
        return math.inf
    tail = losses[-max(1, len(losses) // 10) :]
    return sum(tail) / len(tail)


def train_losses(
    factory: Callable[..., Any], plan: PrecisionPlan, seed: int, steps: int
) -> list[float]:
    """Training losses of ``steps`` steps of the task built for ``seed`` under ``plan``."""
    task = build_task(factory, seed, steps)
    setup = prepare(task.model, task.make_optimizer(task.model), plan)
    losses = []
    for inputs, targets in task.batches:
        with setup.autocast():
            loss = task.loss_fn(call_model(setup.model, inputs), targets)
        setup.backward(loss)
        setup.step()
        setup.zero_grad()
        losses.append(float(loss.detach().float()))
    return losses


@dataclass(frozen=True)
class Arm:
    """One arm of the verification.

    Attributes:
        name: ``"plan"``, ``"bf16-mixed"`` or ``"rule"``.
        layers: its formats per layer.
        final_losses: per seed (see :func:`final_loss`).
        completed: False when ``max_time`` ran out before every seed trained.
        attention: the plan's attention config (None: the attention as it is).
    """

    name: str
    layers: dict[str, str]
    final_losses: list[float]
    completed: bool = True
    attention: AttentionConfig | None = None

    @property
    def mean(self) -> float:
        return statistics.fmean(self.final_losses) if self.final_losses else math.nan

    @property
    def spread(self) -> float:
        """The sample standard deviation of the final losses over seeds (0 for one)."""
        finite = all(math.isfinite(v) for v in self.final_losses)
        if len(self.final_losses) < 2 or not finite:
            return 0.0 if finite else math.inf
        return statistics.stdev(self.final_losses)

    def gap(self, reference: Arm) -> float:
        """Mean over the paired seeds of this arm's final loss minus ``reference``'s."""
        pairs = list(zip(self.final_losses, reference.final_losses, strict=False))
        if not pairs:
            return math.nan
        return statistics.fmean(mine - theirs for mine, theirs in pairs)

    def passed(self, reference: Arm, budget: float) -> bool:
        gap = self.gap(reference)
        return self.completed and math.isfinite(gap) and gap <= budget

    def to_dict(self, reference: Arm, budget: float) -> dict[str, Any]:
        attention = {} if self.attention is None else {"attention": str(self.attention)}
        return {
            "layers": self.layers,
            **attention,
            "final_losses": self.final_losses,
            "mean": self.mean,
            "spread": self.spread,
            "gap": self.gap(reference),
            "completed": self.completed,
            "passed": self.passed(reference, budget),
        }


def verify_arm(
    name: str,
    factory: Callable[..., Any],
    plan: PrecisionPlan,
    seeds: list[int],
    steps: int,
    deadline: float | None,
    progress: Callable[[], None] | None = None,
) -> Arm:
    """Train ``plan`` over ``seeds``; stop (``completed=False``) once ``deadline``
    (``time.monotonic()``) has passed."""
    finals: list[float] = []
    for seed in seeds:
        if deadline is not None and time.monotonic() > deadline:
            return Arm(name, dict(plan.layers), finals, False, plan.attention)
        with torch.random.fork_rng(devices=[]):
            finals.append(final_loss(train_losses(factory, plan, seed, steps)))
        if progress is not None:
            progress()
    return Arm(name, dict(plan.layers), finals, True, plan.attention)
