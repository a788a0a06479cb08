"""Recipes layer: named ways to train in mixed precision, and ``prepare`` to set one up.

``fp32``, ``bf16-mixed`` and ``fp16-mixed`` use autocast only (:mod:`.setup`);
``bf16-master`` and ``fp16-master`` keep float32 masters under the optimizer
(:mod:`.o2`, :mod:`.master`); ``bf16-pure`` and ``bf16-pure-sr`` train in bfloat16
alone with compensated updates (:mod:`.pure`, :mod:`.compensated`, :mod:`.rounding`).
``fp8-*`` run the Linear GEMMs in FP8 over a bfloat16 base recipe (:mod:`.fp8`).
:func:`memory_report` counts what each holds (:mod:`.memory`).
"""

from amped.recipes import fp8 as _fp8
from amped.recipes.compensated import CompensatedAdamW, CompensatedSGD
from amped.recipes.master import MasterWeightOptimizer
from amped.recipes.memory import MemoryReport, memory_report
from amped.recipes.o2 import MasterSetup, build_master_setup
from amped.recipes.pure import PureSetup, build_pure_setup
from amped.recipes.registry import (
    OPT_IN_RECIPES,
    RECIPES,
    Recipe,
    recipe_names,
    register,
    resolve_recipe,
)
from amped.recipes.setup import TrainSetup, prepare, register_builder

register_builder("low-with-masters", build_master_setup)
register_builder("low", build_pure_setup)
register_builder("fp8", _fp8.build_fp8_setup)

__all__ = [
    "OPT_IN_RECIPES",
    "RECIPES",
    "CompensatedAdamW",
    "CompensatedSGD",
    "MasterSetup",
    "MasterWeightOptimizer",
    "MemoryReport",
    "PureSetup",
    "Recipe",
    "TrainSetup",
    "memory_report",
    "prepare",
    "recipe_names",
    "register",
    "register_builder",
    "resolve_recipe",
]
