"""Named precision recipes: what each one does to the model, the optimizer and the loop.

A recipe is a small immutable value. :func:`amped.prepare` reads it to build a
:class:`~amped.recipes.setup.TrainSetup`. Canonical names say the low dtype and how
weights are kept; aliases give the names other tools use (Apex's "O1"/"O2").
"""

from __future__ import annotations

import difflib
from dataclasses import KW_ONLY, dataclass
from typing import Literal

import torch

from amped._internal.errors import type_error, value_error
from amped.optim.rounding import Compensation

__all__ = [
    "OPT_IN_RECIPES",
    "RECIPES",
    "Compensation",
    "Recipe",
    "recipe_names",
    "register",
    "resolve_recipe",
]

Weights = Literal["fp32", "low-with-masters", "low"]


@dataclass(frozen=True)
class Recipe:
    """One way to train with (or without) mixed precision.

    Every field after ``name`` is keyword-only, so that a definition says what each
    setting is (``autocast=True, loss_scaling=False``, not ``True, False``).

    Attributes:
        name: canonical name, e.g. ``"bf16-mixed"``.
        dtype: the low dtype, or None for plain float32.
        weights: ``"fp32"`` keeps float32 weights (autocast casts them per step);
            ``"low-with-masters"`` keeps low-precision model weights and float32 master
            copies in the optimizer (Apex O2); ``"low"`` keeps only low-precision
            weights and optimizer state (pure bf16).
        autocast: whether the forward pass runs in an autocast region.
        loss_scaling: whether a dynamic GradScaler scales the loss (float16).
        aliases: other accepted names.
        summary: one line for help texts and reports.
        compensation: for ``weights="low"``, how an update too small for the low dtype
            survives: ``"kahan"`` keeps the rounding error in a low-precision buffer and
            adds it back next step; ``"stochastic"`` rounds up or down at random, with
            the probabilities that make the rounding unbiased.
        fp8: for the FP8 and block recipes, the name of the config in
            :data:`amped.lowp.CONFIGS` (``"tensorwise"``, ``"rowwise"``,
            ``"rowwise-gw-hp"``, ``"delayed"``) or :data:`amped.lowp.CONFIGS`
            (``"mxfp8"``, ``"mxfp4"``, ``"nvfp4"``); their GEMMs run in that format,
            the rest under bfloat16 autocast, the weights as their base recipe keeps them.
        quantized_state: for ``weights="low"``, keep Adam's moments blockwise quantized
            to 8 bits (:class:`~amped.optim.adamw8bit.CompensatedAdamW8bit`) instead of in
            the weights' dtype.
    """

    name: str
    _: KW_ONLY
    dtype: torch.dtype | None
    weights: Weights
    autocast: bool
    loss_scaling: bool
    aliases: tuple[str, ...]
    summary: str
    compensation: Compensation | None = None
    fp8: str | None = None
    quantized_state: bool = False

    def __post_init__(self) -> None:
        if self.quantized_state and self.weights != "low":
            raise value_error(
                "quantized_state (8-bit Adam moments) needs weights='low': the other "
                f"recipes keep the user's optimizer; this recipe has weights={self.weights!r}",
                "quantized_state",
                self.quantized_state,
            )
        if self.fp8 is not None and self.dtype is not torch.bfloat16:
            raise value_error(
                f"An FP8 recipe (fp8={self.fp8!r}) runs its non-GEMM ops under bfloat16 "
                "autocast: give it dtype=torch.bfloat16",
                "dtype",
                self.dtype,
            )
        if self.weights not in ("fp32", "low-with-masters", "low"):
            raise value_error(
                "Recipe weights are 'fp32', 'low-with-masters' or 'low'", "weights", self.weights
            )
        if self.weights != "fp32" and self.dtype not in (torch.float16, torch.bfloat16):
            raise value_error(
                f"A recipe with weights={self.weights!r} needs a low dtype, torch.float16 or "
                "torch.bfloat16",
                "dtype",
                self.dtype,
            )
        if (self.weights == "low") != (self.compensation is not None):
            raise value_error(
                "compensation ('kahan' or 'stochastic') is required for weights='low' and "
                f"meaningless otherwise; this recipe has weights={self.weights!r}",
                "compensation",
                self.compensation,
            )

    def __str__(self) -> str:
        return self.name


def _builtin(
    name: str,
    dtype: torch.dtype | None,
    weights: Weights,
    aliases: tuple[str, ...],
    summary: str,
    compensation: Compensation | None = None,
    quantized_state: bool = False,
) -> Recipe:
    """A built-in recipe: autocast whenever it has a low dtype, loss scaling for float16."""
    return Recipe(
        name,
        dtype=dtype,
        weights=weights,
        autocast=dtype is not None,
        loss_scaling=dtype is torch.float16,
        aliases=aliases,
        summary=summary,
        compensation=compensation,
        quantized_state=quantized_state,
    )


_BF16, _FP16 = torch.bfloat16, torch.float16
_PURE = "bfloat16 weights, gradients and optimizer state; "

RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        _builtin("fp32", None, "fp32", ("O0", "float32"), "float32 throughout"),
        _builtin(
            "bf16-mixed",
            _BF16,
            "fp32",
            ("bf16", "O1-bf16"),
            "autocast to bfloat16, float32 weights",
        ),
        _builtin(
            "fp16-mixed",
            _FP16,
            "fp32",
            ("fp16", "O1", "amp"),
            "autocast to float16 with dynamic loss scaling, float32 weights",
        ),
        _builtin(
            "bf16-master",
            _BF16,
            "low-with-masters",
            ("O2-bf16", "bf16-O2"),
            "bfloat16 weights and gradients, float32 master weights in the optimizer",
        ),
        _builtin(
            "fp16-master",
            _FP16,
            "low-with-masters",
            ("O2", "fp16-O2"),
            "float16 weights and gradients, float32 master weights, dynamic loss scaling",
        ),
        _builtin(
            "bf16-pure",
            _BF16,
            "low",
            ("pure-bf16", "bf16-kahan"),
            _PURE + "Kahan-compensated updates",
            compensation="kahan",
        ),
        _builtin(
            "bf16-pure-sr",
            _BF16,
            "low",
            ("pure-bf16-sr", "bf16-stochastic"),
            _PURE + "stochastically rounded updates",
            compensation="stochastic",
        ),
    )
}
"""The recipes that exist, by canonical name; :func:`register` adds more."""

OPT_IN_RECIPES: dict[str, Recipe] = {
    recipe.name: recipe
    for recipe in (
        _builtin(
            "bf16-pure-8bit",
            _BF16,
            "low",
            ("pure-bf16-8bit", "bf16-adamw8bit"),
            "bfloat16 weights and gradients, 8-bit blockwise Adam moments, stochastically "
            "rounded updates",
            compensation="stochastic",
            quantized_state=True,
        ),
    )
}
"""Recipes that run only when named (bf16-pure-8bit, whose fused step is not yet fast,
and the FP8 and block ones): ``amped compare``'s default "all" and
:func:`recipe_names` leave them out; :func:`resolve_recipe` finds them."""


def register(recipe: Recipe, *, opt_in: bool = False) -> Recipe:
    """Add a recipe to :data:`RECIPES`, or with ``opt_in=True`` to :data:`OPT_IN_RECIPES`."""
    taken = {n for r in _all_recipes() for n in (r.name, *r.aliases)}
    clash = {recipe.name, *recipe.aliases} & taken
    if clash:
        raise value_error(
            f"Recipe names and aliases are unique; {sorted(clash)} are taken. Choose others",
            "recipe",
            recipe,
        )
    (OPT_IN_RECIPES if opt_in else RECIPES)[recipe.name] = recipe
    return recipe


def _all_recipes() -> list[Recipe]:
    return [*RECIPES.values(), *OPT_IN_RECIPES.values()]


def recipe_names() -> list[str]:
    """Canonical names of all recipes, in registration order."""
    return list(RECIPES)


def resolve_recipe(name: str | Recipe) -> Recipe:
    """The recipe for a canonical name or alias (case-insensitive)."""
    if isinstance(name, Recipe):
        return name
    if not isinstance(name, str):
        raise type_error("recipe must be a name such as 'bf16-mixed'", "recipe", name)
    wanted = name.lower()
    for recipe in _all_recipes():
        if wanted == recipe.name or wanted in (a.lower() for a in recipe.aliases):
            return recipe
    recipes = _all_recipes()
    known = ", ".join(
        f"{r.name} ({', '.join(r.aliases)})" if r.aliases else r.name for r in recipes
    )
    spellings = [n for r in recipes for n in (r.name, *r.aliases)]
    close = difflib.get_close_matches(name, spellings, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else "."
    raise value_error(f"Unknown recipe {name!r}{hint} Recipes (aliases): {known}", "recipe", name)
