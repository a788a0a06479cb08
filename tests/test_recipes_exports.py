"""``amped.recipes`` exports what a user needs to pick, build and inspect a recipe; the
rest (setups of each family, builders, weight lowering) is importable by module path."""

from __future__ import annotations

import amped.recipes

EXPECTED = {
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


def test_all_is_exactly_the_public_api():
    assert set(amped.recipes.__all__) == EXPECTED
    for name in amped.recipes.__all__:
        assert getattr(amped.recipes, name) is not None, name


def test_internals_stay_importable_by_module_path():
    from amped.recipes.build import prepare
    from amped.recipes.o2 import MasterSetup, build_master_setup
    from amped.recipes.pure import PureSetup, build_pure_setup

    assert prepare is amped.recipes.prepare
    assert issubclass(MasterSetup, amped.recipes.TrainSetup)
    assert issubclass(PureSetup, amped.recipes.TrainSetup)
    assert callable(build_master_setup) and callable(build_pure_setup)
