"""Recipes layer: named ways to train in mixed precision, and ``prepare`` to set one up.

``fp32``, ``bf16-mixed`` and ``fp16-mixed`` use autocast only (:mod:`.setup`);
``bf16-master`` and ``fp16-master`` keep float32 masters under the optimizer
(:mod:`.o2`, :class:`amped.optim.MasterWeightOptimizer`); ``bf16-pure`` and
``bf16-pure-sr`` train in bfloat16 alone with compensated updates (:mod:`.pure`,
:class:`amped.optim.CompensatedAdamW`), ``bf16-pure-8bit`` with 8-bit Adam moments;
the optimizers themselves are :mod:`amped.optim`'s. ``fp8-*`` and the block recipes
run the Linear GEMMs in a low-precision format of :mod:`amped.lowp` over a bfloat16
base recipe (:mod:`.lowp`).
:func:`prepare` (:mod:`.build`) sets any of them up; :func:`memory_report` counts
what each holds (:mod:`.memory`); :func:`monitor` watches an FP8 setup's GEMMs
(:mod:`.monitoring`). A :class:`PrecisionPlan` (:mod:`.plan`, chosen by ``amped.tune``)
gives each Linear layer its own format over one base recipe. Everything else is
importable by module path.
"""

from __future__ import annotations

import warnings
from typing import Any

from amped.recipes.build import prepare
from amped.recipes.memory import memory_report
from amped.recipes.monitoring import NonFiniteError, monitor
from amped.recipes.plan import PrecisionPlan
from amped.recipes.registry import Recipe
from amped.recipes.setup import TrainSetup as TrainSetup  # what prepare returns

__all__ = [
    "NonFiniteError",
    "PrecisionPlan",
    "Recipe",
    "memory_report",
    "monitor",
    "prepare",
]

_MOVED = ("CompensatedAdamW", "CompensatedSGD", "MasterWeightOptimizer", "step_in_backward")
"""The optimizers, in :mod:`amped.optim` now; importable from here for one release."""


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module 'amped.recipes' has no attribute {name!r}")
    from amped import optim

    warnings.warn(
        f"amped.recipes.{name} is deprecated and will be removed in the next release; "
        f"use amped.optim.{name}",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(optim, name)
