"""Recipes layer: named ways to train in mixed precision, and ``prepare`` to set one up."""

from amped.recipes.registry import RECIPES, Recipe, recipe_names, register, resolve_recipe
from amped.recipes.setup import TrainSetup, prepare, register_builder

__all__ = [
    "RECIPES",
    "Recipe",
    "TrainSetup",
    "prepare",
    "recipe_names",
    "register",
    "register_builder",
    "resolve_recipe",
]
