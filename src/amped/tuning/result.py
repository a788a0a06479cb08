"""``TuneResult``: what ``amped.tune`` found, and the tuned.json it writes
(``"schema": "amped.tune/1"``, ``"amped.tune/2"`` when the plan has an attention config;
docs/tune.md, "Output").
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from amped._internal.files import write_files
from amped._internal.jsonio import to_json
from amped.recipes.plan import PrecisionPlan
from amped.tuning.choose import Choice
from amped.tuning.measure import LayerMeasurement
from amped.tuning.verify import Arm

__all__ = ["TuneResult"]


@dataclass(frozen=True)
class TuneResult:
    """The chosen plan, the measurements behind it and its verification.

    Attributes:
        plan: the :class:`~amped.recipes.plan.PrecisionPlan`; pass it (or the path of
            the tuned.json :meth:`save` writes) to :func:`amped.prepare`.
        measurements: per eligible layer, in model order.
        budget: the loss budget the plan's summed estimate stays within.
        budget_source: ``"given"``, or how the default was measured.
        choice: the plan's summed estimate and GEMM time saving.
        rule: the first/last-N rule of the ``"rule"`` arm: the best rule that passed its
            verification, else the first one trained; None when no rule could beat the
            estimate's plan (so none was trained) or no plan fits the budget.
        arms: the verification's arms by name: ``"bf16-mixed"``, ``"plan"`` (the plan
            kept), ``"estimate"`` (the estimate's own plan after its rounds, the same
            runs as ``"plan"`` when it was kept) and ``"rule"`` (when a rule trained).
        passes: the measurement's forward+backward passes (see docs/tune.md).
        reason: why the plan lowers no layer, when it does not (else None).
        settings: formats, target, steps, seeds and the other arguments, as given.
        rounds: each verified plan in turn: its index on the estimate's path of
            plans, layers, summed estimate, verified gap, verdict and whether its runs
            completed (:mod:`amped.tuning.search`), then each rule candidate trained;
            every entry says its ``source``; empty when no plan fits the budget.
        source: where the plan came from: ``"estimate"`` or
            ``"rule: first N/last M, <format>"``.
        attention: with ``tune(..., attention=...)``, what was tried on the attention
            roles (tuned.json's ``"attention_tuning"``: the config tried, each role's
            measurement and whether it was kept, the roles' order, the config kept and
            why none was, when none was); None when attention was not tuned.
    """

    plan: PrecisionPlan
    measurements: list[LayerMeasurement]
    budget: float
    budget_source: str
    choice: Choice
    rule: Choice | None
    arms: dict[str, Arm]
    passes: dict[str, Any]
    reason: str | None
    settings: dict[str, Any]
    rounds: list[dict[str, Any]] = field(default_factory=list)
    source: str = "estimate"
    attention: dict[str, Any] | None = None

    @property
    def passed(self) -> bool:
        """Whether the plan's verified loss gap to bfloat16-mixed is within the budget
        (False when the verification did not complete)."""
        return self.arms["plan"].passed(self.arms["bf16-mixed"], self.budget)

    def to_dict(self) -> dict[str, Any]:
        """The content of tuned.json (non-finite numbers as amped's JSON writes them)."""
        reference = self.arms["bf16-mixed"]
        return {
            **self.plan.to_dict(),  # schema, base, layers and the attention config
            "passed": self.passed,
            "source": self.source,
            "reason": self.reason,
            "settings": copy.deepcopy(self.settings),
            "budget": {
                "value": self.budget,
                "source": self.budget_source,
                "plan_estimate": self.choice.estimate,
                "rule_estimate": None if self.rule is None else self.rule.estimate,
            },
            "choice": {
                "saving_flops": self.choice.saving,
                "lowered_flops": _lowered_flops(self.measurements, self.plan.layers),
                "total_flops": sum(m.flops for m in self.measurements),
            },
            "rule": None if self.rule is None else _rule(self.measurements, self.rule),
            "measurements": {m.name: m.to_dict() for m in self.measurements},
            "verification": {
                "seeds": self.settings["seed_list"],
                "steps": self.settings["steps"],
                "final_loss": "mean training loss over the last max(1, steps // 10) steps",
                "arms": {
                    name: arm.to_dict(reference, self.budget) for name, arm in self.arms.items()
                },
                "passed": self.passed,
            },
            "rounds": copy.deepcopy(self.rounds),
            "passes": self.passes,
            "attention_tuning": copy.deepcopy(self.attention),
        }

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write :meth:`to_dict` as JSON to ``path`` (atomically); returns the path.
        :meth:`amped.recipes.plan.PrecisionPlan.load` and ``amped.prepare`` read it."""
        out = Path(path)
        write_files([(out, to_json(self.to_dict(), indent=2) + "\n")])
        return out


def _lowered_flops(measured: list[LayerMeasurement], layers: Mapping[str, str]) -> int:
    return sum(m.flops for m in measured if layers.get(m.name, "bf16") != "bf16")


def _rule(measured: list[LayerMeasurement], rule: Choice) -> dict[str, Any]:
    return {
        "first": rule.first,
        "last": rule.last,
        "format": rule.format,
        "layers": dict(rule.layers),
        "saving_flops": rule.saving,
        "lowered_flops": _lowered_flops(measured, rule.layers),
    }
