"""``amped.prepare``: turn a model and an optimizer into the training setup of a recipe."""

from __future__ import annotations

import os
import warnings

import torch

from amped._internal.errors import type_error, value_error
from amped.lowp.attention_config import AttentionConfig, resolve_config
from amped.lowp.convert import LowPrecisionConfig, ModuleFilter
from amped.optim.shards import check_placements, is_sharded, reshard
from amped.policy import Policy
from amped.recipes.attention import convert_model_attention
from amped.recipes.lowp import LowPrecisionPlan
from amped.recipes.o2 import build_master_setup
from amped.recipes.plan import PrecisionPlan, apply_plan, check_plan
from amped.recipes.pure import build_pure_setup
from amped.recipes.registry import Recipe, resolve_recipe
from amped.recipes.setup import TrainSetup
from amped.recipes.weights import require_float32, ruled_modules
from amped.scaling import GradScaler

__all__ = ["prepare"]


def prepare(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    recipe: str | Recipe | PrecisionPlan | os.PathLike[str] = "bf16-mixed",
    *,
    policy: Policy | str | None = None,
    scaler: GradScaler | None = None,
    base: str | Recipe | None = None,
    module_filter: ModuleFilter | None = None,
    config: LowPrecisionConfig | None = None,
    fp8_config: LowPrecisionConfig | None = None,
    attention: str | AttentionConfig | None = None,
) -> TrainSetup:
    """Turn ``model`` and ``optimizer`` into a :class:`TrainSetup` for ``recipe``.

    The autocast recipes (``fp32``, ``bf16-mixed``, ``fp16-mixed``) leave model and
    optimizer as they are. The others change them in place: ``*-master`` lowers the
    weights (except modules the policy keeps in float32; norms by default) and puts
    float32 masters under the optimizer (``setup.optimizer`` is a
    :class:`~amped.optim.MasterWeightOptimizer`); ``bf16-pure*`` lowers every weight
    and replaces SGD/Adam/AdamW by its compensated twin (``setup.optimizer``). Always
    step ``setup.optimizer``, through :meth:`TrainSetup.step`.

    Args:
        model: the model, on its device, in float32.
        optimizer: a ``torch.optim`` optimizer built over ``model.parameters()``.
        recipe: a recipe name or alias (see :data:`amped.recipes.registry.RECIPES`), or
            a per-layer plan: a :class:`~amped.recipes.plan.PrecisionPlan`, or the path of
            a ``tuned.json`` written by ``amped.tune`` (a ``pathlib.Path``, or a string
            ending in ``.json``); see docs/tune.md. A plan's attention config, when it
            has one, is applied as ``attention=`` applies it.
        policy: the autocast policy (an :class:`amped.Policy` or preset name).
        scaler: a GradScaler to use instead of the recipe's default one.
        base: FP8 recipes only: the recipe that keeps weights and optimizer state
            (``bf16-mixed`` by default, ``bf16-master``, ``bf16-pure``, ``bf16-pure-sr``).
        module_filter: FP8 recipes only: ``filter(linear, name) -> bool`` choosing the
            ``nn.Linear`` layers to convert (default:
            :func:`amped.lowp.convert.default_module_filter`).
        config: FP8 and block recipes only: a variant of the recipe's config to use
            instead, e.g. ``amped.lowp.CONFIGS["nvfp4"].replace(hadamard=False)``.
        fp8_config: deprecated spelling of ``config`` (warns; removed next release).
        attention: any recipe: run the model's attention through
            :func:`amped.scaled_dot_product_attention` with this config (a preset name,
            e.g. ``"fp8"``, or an :class:`~amped.lowp.AttentionConfig`): every
            ``nn.MultiheadAttention`` and a transformers model's attention layers
            convert; ``setup.attention`` lists those that did not, and why
            (:class:`~amped.recipes.attention.AttentionConversion`).

    Raises:
        ValueError: an unknown recipe, a model on several device types, an optimizer
            over other parameters, or a weight-changing recipe on a model that is
            not float32.
        TypeError: an optimizer the recipe cannot use (it says which, and why).

    Example:
        >>> import torch, amped
        >>> model = torch.nn.Linear(4, 2)
        >>> setup = amped.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> with setup.autocast():
        ...     loss = setup.model(torch.randn(3, 4)).float().pow(2).mean()
        >>> setup.backward(loss)
        >>> setup.step()
        True
    """
    attention_config = None if attention is None else resolve_config(attention)  # first
    if isinstance(recipe, os.PathLike) or (isinstance(recipe, str) and recipe.endswith(".json")):
        recipe = PrecisionPlan.load(recipe)
    if (
        attention_config is not None
        and isinstance(recipe, PrecisionPlan)
        and recipe.attention is not None
    ):
        raise value_error(
            f"The plan carries its own attention config ({recipe.attention}), which prepare "
            "applies; pass attention= only with a recipe name or a plan without one",
            "attention",
            attention,
        )
    setup = _prepare(model, optimizer, recipe, policy, scaler, base, module_filter,
                     _config_argument(config, fp8_config))  # fmt: skip
    if attention_config is not None:
        setup.attention = convert_model_attention(setup.model, attention_config)
    return setup


def _prepare(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    recipe: str | Recipe | PrecisionPlan,
    policy: Policy | str | None,
    scaler: GradScaler | None,
    base: str | Recipe | None,
    module_filter: ModuleFilter | None,
    config: LowPrecisionConfig | None,
) -> TrainSetup:
    if isinstance(recipe, PrecisionPlan):
        return _prepare_plan(model, optimizer, recipe, policy, scaler, base, module_filter, config)
    chosen = resolve_recipe(recipe)
    fp8_only = {"base": base, "module_filter": module_filter, "config": config}
    given = {name: value for name, value in fp8_only.items() if value is not None}
    if chosen.fp8 is None and given:
        name, value = next(iter(given.items()))
        raise value_error(
            f"base, module_filter and config apply to the FP8 and block recipes only; "
            f"{chosen.name!r} is not one",
            name,
            value,
        )
    reshard(model)  # FSDP2's root holds unsharded parameters after a forward
    device_type = _device_type(model)
    optimizer = _check_optimizer(model, optimizer)
    if isinstance(policy, str):
        policy = Policy.preset(policy, device_type)
    if scaler is None:
        scaler = GradScaler(device_type, enabled=chosen.loss_scaling)
    plain = TrainSetup(chosen, model, optimizer, scaler, device_type, policy)
    if chosen.fp8 is None:
        return _build(plain)
    fp8 = LowPrecisionPlan.check(plain, base, module_filter, config)  # before anything changes
    return fp8.apply(_build(TrainSetup(fp8.base, model, optimizer, scaler, device_type, policy)))


def _config_argument(
    config: LowPrecisionConfig | None, fp8_config: LowPrecisionConfig | None
) -> LowPrecisionConfig | None:
    """``config``, or the deprecated ``fp8_config`` in its place (with a warning)."""
    if fp8_config is None:
        return config
    warnings.warn(
        "prepare's fp8_config argument is deprecated and will be removed in the next "
        "release; "
        "pass config=... (a Float8Config or a BlockConfig)",
        DeprecationWarning,
        stacklevel=3,
    )
    if config is not None:
        raise type_error(
            "prepare takes config or its deprecated spelling fp8_config, not both; pass "
            "config only",
            "fp8_config",
            fp8_config,
        )
    return fp8_config


def _prepare_plan(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: PrecisionPlan,
    policy: Policy | str | None,
    scaler: GradScaler | None,
    *fp8_only: object,
) -> TrainSetup:
    """The setup of a per-layer plan: its base recipe's, then each lowered layer converted."""
    if any(value is not None for value in fp8_only):
        raise value_error(
            "A plan carries its own base and per-layer formats; pass base, module_filter "
            "and config only with an FP8 or block recipe name",
            "plan",
            plan,
        )
    base = resolve_recipe(plan.base)
    device_type = _device_type(model)
    optimizer = _check_optimizer(model, optimizer)
    if isinstance(policy, str):
        policy = Policy.preset(policy, device_type)
    check_plan(plan, model, device_type, scaler, ruled_modules(model, policy))  # first
    if scaler is None:
        scaler = GradScaler(device_type, enabled=False)
    setup = _build(TrainSetup(base, model, optimizer, scaler, device_type, policy))
    return apply_plan(plan, setup)


def _build(plain: TrainSetup) -> TrainSetup:
    """The setup of ``plain.recipe``: ``plain`` itself for the autocast recipes."""
    if plain.recipe.weights == "fp32":
        return plain
    _check_lowerable(plain.model, plain.recipe)
    if plain.recipe.weights == "low-with-masters":
        return build_master_setup(plain)
    return build_pure_setup(plain)


def _device_type(model: torch.nn.Module) -> str:
    devices = {p.device.type for p in model.parameters()}
    if len(devices) != 1:
        raise value_error(
            "prepare() needs a model whose parameters are all on one device type (and at "
            "least one parameter); move it with model.to(device)",
            "parameter device types",
            sorted(devices),
        )
    return devices.pop()


def _check_optimizer(model: torch.nn.Module, optimizer: object) -> torch.optim.Optimizer:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise type_error(
            "prepare() takes a torch.optim.Optimizer over the model's parameters",
            "optimizer",
            optimizer,
        )
    model_params = {id(p) for p in model.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in model_params:
                raise ValueError(
                    "The optimizer holds a parameter that is not the model's; build the "
                    "optimizer over model.parameters()."
                )
    return optimizer


def _check_lowerable(model: torch.nn.Module, recipe: Recipe) -> None:
    for name, param in model.named_parameters():
        if is_sharded(param) and recipe.weights == "low":
            # bf16-pure*: the shards are lowered in place and the optimizer steps them.
            check_placements(name, param)
        elif is_sharded(param):
            # Lowering a DTensor changes its metadata, not FSDP2's float32 local shards.
            raise value_error(
                f"Recipe {recipe.name!r} lowers the model's weights, but its parameters are "
                "DTensors (sharded by fully_shard, or tensor parallel); lowering one leaves "
                "the float32 shards FSDP2 keeps. For master weights under FSDP2, pass mp_policy="
                "MixedPrecisionPolicy(param_dtype=..., reduce_dtype=torch.float32) to "
                "fully_shard (the float32 shards are the masters) and use a '-mixed' "
                "recipe; see docs/distributed.md",
                f"type({name})",
                type(param),
            )
    require_float32(
        model,
        f"Recipe {recipe.name!r} lowers a float32 model's weights itself (and keeps float32 "
        "copies where it needs them)",
    )
