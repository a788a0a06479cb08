"""Which layers the FP8 and block recipes convert: ``--module-filter``, ``--exclude``,
and the dry run that checks every recipe against the model before anything trains.

Both flags take names or regular expressions, comma-separated, each matched against a
layer's whole qualified name (``re.fullmatch``: ``h.0.mlp.c_fc``, ``h\\.\\d+\\.mlp\\..*``).
``--module-filter`` replaces the default choice (layers whose dims are multiples of 16,
32 for the MX formats, with at least 64 x 64 weights, except the output head:
:mod:`amped.lowp.convert`); ``--exclude`` keeps layers out of either. The dry run
converts a copy of the model for each such recipe, so a layer the format cannot run,
or a recipe that converts nothing, is a usage error (exit 2) before any training, and
before the report folder is touched.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

import torch

from amped.lowp.convert import ModuleFilter, convert_layers, default_filter, explain_layers
from amped.recipes import Recipe
from amped.recipes.lowp import recipe_config
from amped.tasks.errors import UsageError

__all__ = ["Conversion", "LayerChoice", "dry_run", "parse_layer_patterns"]


def parse_layer_patterns(text: str | None, flag: str) -> tuple[re.Pattern[str], ...]:
    """``--module-filter`` / ``--exclude``: comma-separated names or regular expressions."""
    if text is None:
        return ()
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise UsageError(
            f"{flag} names no layer; give layer names or regular expressions, "
            f"comma-separated (e.g. {flag} 'h.0.mlp.c_fc,h\\.1\\..*'). Received: {flag} {text!r}"
        )
    patterns = []
    for item in items:
        try:
            patterns.append(re.compile(item))
        except re.error as error:
            raise UsageError(
                f"{flag}: {item!r} is not a regular expression ({error}); give layer names "
                f"or regular expressions, comma-separated. Received: {flag} {text!r}"
            ) from None
    return tuple(patterns)


def _matches(patterns: tuple[re.Pattern[str], ...], name: str) -> bool:
    return any(pattern.fullmatch(name) for pattern in patterns)


@dataclass(frozen=True)
class LayerChoice:
    """``--module-filter`` and ``--exclude`` as given (None: not given)."""

    module_filter: str | None = None
    exclude: str | None = None

    def __post_init__(self) -> None:
        parse_layer_patterns(self.module_filter, "--module-filter")
        parse_layer_patterns(self.exclude, "--exclude")

    @property
    def given(self) -> bool:
        return self.module_filter is not None or self.exclude is not None

    def filter_for(self, model: torch.nn.Module, recipe: Recipe) -> ModuleFilter | None:
        """The ``module_filter`` to give :func:`amped.prepare` for ``recipe`` on
        ``model``; None when neither flag was given (prepare's default)."""
        if recipe.fp8 is None or not self.given:
            return None
        excluded = self.excluded(model)
        base = self.chosen() or default_filter(model, recipe_config(recipe))

        def keep(layer: torch.nn.Module, name: str) -> bool:
            return name not in excluded and base(layer, name)

        return keep

    def chosen(self) -> ModuleFilter | None:
        """``--module-filter`` alone as a filter; None when not given."""
        patterns = parse_layer_patterns(self.module_filter, "--module-filter")
        return (lambda layer, name: _matches(patterns, name)) if patterns else None

    def excluded(self, model: torch.nn.Module) -> set[str]:
        """The names of ``model``'s modules ``--exclude`` keeps out."""
        patterns = parse_layer_patterns(self.exclude, "--exclude")
        return {name for name, _ in model.named_modules() if _matches(patterns, name)}

    def by_name(self) -> ModuleFilter | None:
        """Both flags as one filter of qualified names (``amped tune``'s); None when
        neither was given."""
        if not self.given:
            return None
        chosen = parse_layer_patterns(self.module_filter, "--module-filter")
        excluded = parse_layer_patterns(self.exclude, "--exclude")

        def keep(layer: torch.nn.Module, name: str) -> bool:
            return not _matches(excluded, name) and (not chosen or _matches(chosen, name))

        return keep

    def describe(self) -> str:
        """The flags as a user gave them, for messages."""
        flags = (("module-filter", self.module_filter), ("exclude", self.exclude))
        given = [f"--{flag} {value!r}" for flag, value in flags if value]
        return " ".join(given) or "no --module-filter"


@dataclass(frozen=True)
class Conversion:
    """What one FP8/block recipe converts on the model: layer names, and those it does
    not with the reason (``results.json``'s ``conversion``)."""

    recipe: str
    converted: tuple[str, ...]
    kept_out: dict[str, str]

    def as_dict(self) -> dict[str, Any]:
        return {"converted": list(self.converted), "kept_out": dict(self.kept_out)}

    def line(self) -> str:
        """One line for the progress output."""
        kept = f"; {len(self.kept_out)} kept out" if self.kept_out else ""
        return f"{self.recipe}: converts {len(self.converted)} layer(s){kept}"


def dry_run(
    model: torch.nn.Module, recipes: tuple[Recipe, ...], choice: LayerChoice
) -> list[Conversion]:
    """Convert a copy of ``model`` for each FP8/block recipe in ``recipes``.

    Raises:
        UsageError: a recipe converts no layer, or cannot convert one the flags chose;
            the message names each layer, why it stays out, and ``--module-filter``.
    """
    conversions = []
    for recipe in recipes:
        if recipe.fp8 is None:
            continue
        config = recipe_config(recipe)
        reasons = explain_layers(model, choice.chosen(), choice.excluded(model), config)
        names = [name for name, why in reasons.items() if why is None]
        kept = {name or "<model>": str(why) for name, why in reasons.items() if why is not None}
        if not names:
            raise UsageError(_none_converted(recipe, kept, choice))
        try:
            convert_layers(copy.deepcopy(model), config, names)
        except (ValueError, TypeError):
            raise UsageError(_cannot_convert(model, recipe, names, choice)) from None
        conversions.append(Conversion(recipe.name, tuple(names), kept))
    return conversions


def _none_converted(recipe: Recipe, kept: dict[str, str], choice: LayerChoice) -> str:
    layers = "; ".join(f"{name}: {why}" for name, why in kept.items())
    return (
        f"Recipe {recipe.name} converts no layer of this model, so it would train as "
        "bf16-mixed: every nn.Linear/Conv1D stays out. Choose layers with --module-filter "
        "(names or regular expressions, comma-separated), or leave the recipe out of "
        f"--recipes. Layers ({choice.describe()}): {layers or 'none'}"
    )


def _cannot_convert(
    model: torch.nn.Module, recipe: Recipe, names: list[str], choice: LayerChoice
) -> str:
    """The message for chosen layers the format cannot run: each one, and why."""
    config, modules, refused = recipe_config(recipe), dict(model.named_modules()), []
    for name in names:
        try:
            convert_layers(copy.deepcopy(modules[name]), config, [""])
        except (ValueError, TypeError) as error:
            why = str(error).strip().splitlines()[0].split(" Received: ")[0].rstrip(".")
            refused.append(f"{name or '<model>'}: {why}")
    return (
        f"Recipe {recipe.name} cannot convert layers that {choice.describe()} chose; choose "
        "others with --module-filter, or leave them out with --exclude. Received: "
        + "; ".join(refused or names)
    )
