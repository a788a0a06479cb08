"""The FP8 and block recipes: low-precision GEMMs in the Linear layers, a base recipe
for everything else.

``fp8-tensorwise``, ``fp8-rowwise`` and ``fp8-rowwise-gw-hp`` are torchao's float8
training recipes; ``fp8-delayed`` is Transformer Engine's delayed scaling;
``fp8-blockwise`` is DeepSeek-V3's blockwise scaling (Transformer Engine's
``Float8BlockScaling``: E4M3, 1x128 activation and gradient tiles, 128x128 weight
tiles; see :mod:`amped.lowp`). The block recipes ``mxfp8``, ``mxfp4`` and ``nvfp4`` cast with
per-block scales (:data:`amped.lowp.CONFIGS`); ``prepare(..., config=...)``
takes a variant of the recipe's config, e.g. ``BLOCK_CONFIGS["nvfp4"].replace(
hadamard=False)``. ``prepare`` builds the base recipe's setup first (``bf16-mixed`` by
default; ``bf16-master``, ``bf16-pure`` or ``bf16-pure-sr`` by choice: weights and
optimizer state follow it), then converts the chosen ``nn.Linear`` and transformers
``Conv1D`` layers in place.
Ops outside those layers run under the base recipe's bfloat16 autocast policy. A
module that any of the policy's module rules names stays out of FP8 (with its
children): ``"fp32"`` and ``"skip"`` run it in float32, ``"low"`` in bfloat16, as
for every other recipe. Layers the module filter rejects stay out too.

Under FSDP2, convert first (:func:`amped.lowp.convert_to_low_precision` with the recipe's config),
then ``fully_shard``, build the optimizer and call ``prepare``: it adopts the layers
already converted (torchao asks for the same order).

These recipes are opt-in: ``amped compare`` runs them when named in ``--recipes``.
"""

from __future__ import annotations

import dataclasses

import torch

from amped._internal.errors import value_error
from amped.lowp import Float8Config, Float8Linear
from amped.lowp.convert import (
    LowPrecisionConfig,
    LowPrecisionLayers,
    ModuleFilter,
    convert_layers,
    no_layer_error,
    plan_low_precision,
)
from amped.lowp.float8.config import FLOAT8_CONFIGS
from amped.lowp.mx.block_config import BLOCK_CONFIGS, BlockConfig
from amped.lowp.mx.block_linear import BlockLinear
from amped.policy import Policy
from amped.recipes.lowp_wire import install_low_precision_wire
from amped.recipes.registry import Recipe, register, resolve_recipe
from amped.recipes.setup import TrainSetup
from amped.recipes.weights import require_float32, ruled_modules

__all__ = [
    "BLOCK_RECIPE_NAMES",
    "FP8_BASES",
    "FP8_RECIPE_NAMES",
    "LowPrecisionPlan",
    "recipe_config",
]

FP8_BASES = ("bf16-mixed", "bf16-master", "bf16-pure", "bf16-pure-sr")
"""Base recipes an FP8 recipe can keep its weights and optimizer state by."""

_ALIASES = {
    "tensorwise": (),
    "rowwise": (),
    "rowwise-gw-hp": (),
    "delayed": ("fp8-te",),
    "blockwise": (),
}

FP8_RECIPE_NAMES = tuple(
    register(
        Recipe(
            f"fp8-{scaling}",
            dtype=torch.bfloat16,
            weights="fp32",
            autocast=True,
            loss_scaling=False,
            aliases=aliases,
            summary=f"FP8 Linear GEMMs ({FLOAT8_CONFIGS[scaling]}), bfloat16 autocast elsewhere",
            fp8=scaling,
        ),
        opt_in=True,
    ).name
    for scaling, aliases in _ALIASES.items()
)


_BLOCK_SUMMARIES = {
    "mxfp8": "MXFP8 Linear GEMMs (e4m3, 32-blocks, E8M0 scales), bfloat16 autocast elsewhere",
    "mxfp4": "MXFP4 Linear GEMMs (e2m1, 32-blocks, E8M0 scales), bfloat16 autocast elsewhere",
    "nvfp4": "NVFP4 Linear GEMMs (NVIDIA's recipe: 16x16 weights, SR, Hadamard, last "
    "layers bf16), bfloat16 autocast elsewhere",
}

BLOCK_RECIPE_NAMES = tuple(
    register(
        Recipe(
            name,
            dtype=torch.bfloat16,
            weights="fp32",
            autocast=True,
            loss_scaling=False,
            aliases=(),
            summary=summary,
            fp8=name,
        ),
        opt_in=True,
    ).name
    for name, summary in _BLOCK_SUMMARIES.items()
)


def recipe_config(recipe: Recipe) -> LowPrecisionConfig:
    """The named config of an FP8 or block recipe."""
    assert recipe.fp8 is not None
    return BLOCK_CONFIGS[recipe.fp8] if recipe.fp8 in BLOCK_CONFIGS else FLOAT8_CONFIGS[recipe.fp8]


def _chosen_config(recipe: Recipe, override: LowPrecisionConfig | None) -> LowPrecisionConfig:
    """The recipe's config, or the user's variant of it (same kind, same block format)."""
    named = recipe_config(recipe)
    if override is None:
        return named
    if isinstance(named, BlockConfig):
        fits = isinstance(override, BlockConfig) and override.format == named.format
        wanted = f"a BlockConfig in {named.format.name}, e.g. amped.lowp.CONFIGS"
    else:
        fits = isinstance(override, Float8Config)
        wanted = "an amped.lowp.Float8Config, e.g. from amped.lowp.CONFIGS"
    if not fits:
        raise value_error(
            f"Recipe {recipe.name!r} takes as config {wanted}[{recipe.fp8!r}]"
            ".replace(...) or dataclasses.replace(...)",
            "config",
            override,
        )
    return override


def _check_model(recipe: Recipe, model: torch.nn.Module, device_type: str) -> None:
    if device_type not in ("cpu", "cuda"):
        raise value_error(
            f"Recipe {recipe.name!r} runs on cpu (emulated or torch's CPU FP8 GEMM) and cuda; "
            "move the model to one of them",
            "device_type",
            device_type,
        )
    require_float32(
        model,
        f"Recipe {recipe.name!r} casts float32 weights to FP8 (the base recipe lowers them "
        "where it should)",
    )


def _base_recipe(recipe: Recipe, base: str | Recipe | None) -> Recipe:
    chosen = resolve_recipe(base or "bf16-mixed")
    if chosen.name not in FP8_BASES:
        why = (
            "float16 autocast is refused: FP8 recipes run bfloat16 around the FP8 GEMMs"
            if chosen.dtype is torch.float16
            else "it is not a bfloat16 recipe"
        )
        raise value_error(
            f"Recipe {recipe.name!r} cannot take base={chosen.name!r} ({why}); bases are "
            f"{', '.join(FP8_BASES)}",
            "base",
            base,
        )
    return chosen


def _same_rules(config: LowPrecisionConfig, layer: Float8Linear | BlockLinear) -> bool:
    if isinstance(layer, BlockLinear):
        return layer.block_config == config
    own = layer.float8_config
    if not isinstance(config, Float8Config) or (own.delayed is None) != (config.delayed is None):
        return False
    # Delayed scaling's own settings (history length, amax rule, margin) are free.
    return dataclasses.replace(config, delayed=own.delayed) == own


def _already_converted(
    recipe: Recipe, model: torch.nn.Module, config: LowPrecisionConfig
) -> LowPrecisionLayers | None:
    """The model's converted layers, when it was converted before (FSDP2: convert,
    then ``fully_shard``, then build the optimizer and call ``prepare``; or to choose
    delayed scaling's history length, amax rule and margin)."""
    layers: dict[str, Float8Linear | BlockLinear] = {
        n: m for n, m in model.named_modules() if isinstance(m, Float8Linear | BlockLinear)
    }
    if not layers:
        return None
    for name, layer in layers.items():
        if not _same_rules(config, layer):
            own = layer.block_config if isinstance(layer, BlockLinear) else layer.float8_config
            raise value_error(
                f"Recipe {recipe.name!r} found layer {name!r} converted to FP8 with other "
                "rules; convert with the recipe's config "
                f"(amped.lowp.CONFIGS[{recipe.fp8!r}], or the config passed to prepare)",
                f"{name} rules",
                str(own),
            )
    return LowPrecisionLayers(layers, config)


@dataclasses.dataclass(frozen=True)
class LowPrecisionPlan:
    """What an FP8 or block recipe will do, checked before its base recipe changes anything.

    :func:`~amped.prepare` calls :meth:`check`, builds the base recipe's setup, then
    :meth:`apply` converts the chosen Linear layers.

    Attributes:
        recipe: the FP8 recipe.
        base: the recipe that keeps the weights and optimizer state.
        policy: the user's policy, whose module rules keep modules out of FP8.
        module_filter: the user's filter (None: :func:`amped.lowp.convert.default_module_filter`).
        converted: layers the model had converted before ``prepare`` (FSDP2), else None.
        config: the cast rules: the recipe's named config or the user's variant.
    """

    recipe: Recipe
    base: Recipe
    policy: Policy | None
    module_filter: ModuleFilter | None
    converted: LowPrecisionLayers | None
    config: LowPrecisionConfig

    @classmethod
    def check(
        cls,
        plain: TrainSetup,
        base: str | Recipe | None,
        module_filter: ModuleFilter | None,
        config: LowPrecisionConfig | None = None,
    ) -> LowPrecisionPlan:
        """Refuse what ``plain.recipe`` cannot run (base, model, scaler, no layer to convert)."""
        recipe, model = plain.recipe, plain.model
        if recipe.fp8 is None:
            raise value_error(
                "LowPrecisionPlan is for the FP8 and block recipes only", "recipe", recipe.name
            )
        base_recipe = _base_recipe(recipe, base)
        _check_model(recipe, model, plain.device_type)
        if plain.scaler.is_enabled():
            raise value_error(
                f"Recipe {recipe.name!r} does not scale the loss (bfloat16 gradients do not "
                "underflow, FP8 casts have their own scales); pass no scaler",
                "scaler.is_enabled()",
                True,
            )
        config = _chosen_config(recipe, config)
        converted = _already_converted(recipe, model, config)
        ruled = ruled_modules(model, plain.policy)
        if converted is None and not plan_low_precision(model, module_filter, ruled, config):
            # no layer to convert: each layer and why it stays out
            raise no_layer_error(model, module_filter, ruled, config)
        return cls(recipe, base_recipe, plain.policy, module_filter, converted, config)

    def apply(self, setup: TrainSetup) -> TrainSetup:
        """Convert the chosen layers of the base recipe's ``setup``; returns ``setup`` with
        ``recipe`` the FP8 recipe (``weights`` and ``compensation`` the base's) and
        ``low_precision_layers`` the converted layers, which :meth:`~amped.recipes.TrainSetup.step`
        updates."""
        assert self.recipe.fp8 is not None  # check() refused the others
        converted = self.converted
        if converted is None:
            model = setup.model
            keep = ruled_modules(model, self.policy) | ruled_modules(model, setup.policy)
            names = plan_low_precision(model, self.module_filter, keep, self.config)
            converted = convert_layers(model, self.config, names)
        setup.low_precision_layers = converted
        install_low_precision_wire(setup.model, converted)  # FSDP2: FP8 weights on the wire
        setup.low_precision_base = self.base.name
        setup.recipe = dataclasses.replace(
            self.recipe, weights=self.base.weights, compensation=self.base.compensation
        )
        return setup
