"""Recipes layer: named ways to train in mixed precision, and ``prepare`` to set one up.

``fp32``, ``bf16-mixed`` and ``fp16-mixed`` use autocast only (:mod:`.setup`);
``bf16-master`` and ``fp16-master`` keep float32 masters under the optimizer
(:mod:`.o2`, :mod:`.master`); ``bf16-pure`` and ``bf16-pure-sr`` train in bfloat16
alone with compensated updates (:mod:`.pure`, :mod:`.compensated`, :mod:`.rounding`),
``bf16-pure-8bit`` with 8-bit Adam moments (:mod:`.adamw8bit`, :mod:`.quantized_state`);
:func:`step_in_backward` steps their optimizers in backward (:mod:`.in_backward`).
``fp8-*`` run the Linear GEMMs in FP8 over a bfloat16 base recipe (:mod:`.fp8`).
:func:`prepare` (:mod:`.build`) sets any of them up; :func:`memory_report` counts
what each holds (:mod:`.memory`); :func:`monitor` watches an FP8 setup's GEMMs
(:mod:`.monitoring`). A :class:`PrecisionPlan` (:mod:`.plan`, chosen by ``amped.tune``)
gives each Linear layer its own format over one base recipe. Everything else is
importable by module path.
"""

from amped.recipes.build import prepare
from amped.recipes.compensated import CompensatedAdamW, CompensatedSGD
from amped.recipes.in_backward import step_in_backward
from amped.recipes.master import MasterWeightOptimizer
from amped.recipes.memory import memory_report
from amped.recipes.monitoring import NonFiniteError, monitor
from amped.recipes.plan import PrecisionPlan
from amped.recipes.registry import Recipe
from amped.recipes.setup import TrainSetup

__all__ = [
    "CompensatedAdamW",
    "CompensatedSGD",
    "MasterWeightOptimizer",
    "NonFiniteError",
    "PrecisionPlan",
    "Recipe",
    "TrainSetup",
    "memory_report",
    "monitor",
    "prepare",
    "step_in_backward",
]
