"""``amped.recipes`` and ``amped.fp8`` export what a user needs to pick, build and inspect
a recipe and to convert a model to FP8; the rest is importable by module path."""

from __future__ import annotations

import pytest
import torch

import amped.fp8
import amped.recipes

RECIPES_API = {
    "OPT_IN_RECIPES",
    "RECIPES",
    "CompensatedAdamW",
    "CompensatedSGD",
    "MasterWeightOptimizer",
    "MemoryReport",
    "Recipe",
    "TrainSetup",
    "memory_report",
    "prepare",
    "recipe_names",
    "register",
    "resolve_recipe",
}
FP8_API = {
    "FP8_CONFIGS",
    "CastRule",
    "DelayedScaling",
    "Float8Linear",
    "Fp8Config",
    "Fp8Layers",
    "Fp8Tensor",
    "ModuleFilter",
    "convert_to_fp8",
    "default_module_filter",
    "plan_fp8",
    "quantize",
    "scaled_mm",
    "sqnr",
}


@pytest.mark.parametrize(
    ("package", "expected"), [(amped.recipes, RECIPES_API), (amped.fp8, FP8_API)], ids=str
)
def test_all_is_exactly_the_public_api(package, expected):
    assert set(package.__all__) == expected
    for name in package.__all__:
        assert getattr(package, name) is not None, name


def test_internals_stay_importable_by_module_path():
    from amped.fp8.cast import FP8_DTYPES, amax_to_scale
    from amped.fp8.delayed import update_delayed_scaling
    from amped.fp8.gemm import has_scaled_mm
    from amped.recipes.build import prepare
    from amped.recipes.o2 import MasterSetup, build_master_setup
    from amped.recipes.pure import PureSetup, build_pure_setup

    assert prepare is amped.recipes.prepare
    assert issubclass(MasterSetup, amped.recipes.TrainSetup)
    assert issubclass(PureSetup, amped.recipes.TrainSetup)
    assert (torch.float8_e4m3fn, torch.float8_e5m2) == FP8_DTYPES
    for function in (build_master_setup, build_pure_setup, amax_to_scale, has_scaled_mm):
        assert callable(function)
    assert callable(update_delayed_scaling) and not hasattr(amped.fp8, "update_delayed_scaling")
