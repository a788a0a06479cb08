"""``CompareResult``: a comparison as the ``results.json`` document, field for field
(``"schema": "amped.compare/1"``; docs/results-schema.md, docs/results-schema.json).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from amped._internal.files import write_files
from amped.comparison.compare import Comparison
from amped.comparison.environment import describe
from amped.comparison.results import dumps, to_dict

__all__ = ["CompareResult"]


@dataclass(frozen=True)
class CompareResult:
    """What :func:`amped.compare` measured: each field is the ``results.json`` key of the
    same name, so ``dataclasses.asdict(result)`` (and :meth:`to_dict`) is that document.

    Attributes:
        schema: ``"amped.compare/1"``.
        partial: whether Ctrl-C (or SIGTERM) stopped the comparison early.
        created: when the document was made (UTC, ISO 8601).
        command: the ``amped compare`` command line that repeats the comparison.
        wall_s: seconds the comparison took, probes and planning included.
        config: the arguments, as used (``task``, ``recipes``, ``steps``, ...).
        conversion: per FP8 or block recipe, which layers its dry run converts and why
            each other one stays in high precision.
        attention: with ``--attention``, its config and the attention modules it could
            not convert, with the reason (None without it).
        environment: amped, torch, Python, the device and the CPU.
        machine: the CPU load while it ran (None off the CPU).
        task: the task's name, description and details.
        warmup: each recipe's warm-up steps (compiles, cache loads), outside the budget.
        plan: how ``max_time`` was spread over the recipes (None without a limit).
        budget: ``max_time`` and what it cut.
        samples_per_step: the batch size the factory produced.
        speed: whether speeds may be compared, and why not.
        baseline: the recipe the others are measured against (``"fp32"``).
        common_step: the last step every recipe reached.
        identical_losses: groups of recipes whose losses coincide at every step.
        recipes: one entry per recipe, baseline first: status, losses, speed, memory,
            held-out metrics and notes (docs/results-schema.md).
    """

    schema: str
    partial: bool
    created: str
    command: list[str]
    wall_s: float
    config: dict[str, Any]
    conversion: dict[str, Any]
    attention: dict[str, Any] | None
    environment: dict[str, Any]
    machine: dict[str, Any] | None
    task: dict[str, Any] | None
    warmup: dict[str, Any]
    plan: dict[str, Any] | None
    budget: dict[str, Any] | None
    samples_per_step: float | None
    speed: dict[str, Any]
    baseline: str | None
    common_step: int | None
    identical_losses: list[list[str]]
    recipes: list[dict[str, Any]]

    @classmethod
    def of(cls, comparison: Comparison, command: list[str]) -> CompareResult:
        """The result of ``comparison``, run by ``command``."""
        return cls(**to_dict(comparison, describe(comparison.config.device), command))

    def to_dict(self) -> dict[str, Any]:
        """The ``results.json`` document (a deep copy: changing it leaves this alone)."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """The ``results.json`` text, as ``amped compare`` writes it."""
        return dumps(self.to_dict())

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write :meth:`to_json` to ``path`` (e.g. ``"results.json"``), atomically;
        returns the path."""
        target = Path(path)
        write_files([(target, self.to_json())])
        return target
