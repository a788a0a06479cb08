"""``PrecisionPlan``: a format per Linear layer over one base recipe, and its setup.

A plan is what ``amped.tune`` chooses and what :func:`amped.prepare` accepts in the
recipe position (the object, or the path of a ``tuned.json``)::

    plan = PrecisionPlan("bf16-mixed", {"h.0.mlp.c_fc": "fp8-rowwise", "lm_head": "bf16"})
    setup = amped.prepare(model, optimizer, plan)

Every layer the plan names in a low-precision format is converted in place with that
format's named config (:data:`amped.lowp.CONFIGS`, :data:`amped.lowp.CONFIGS`),
layers of one format in model order, as ``prepare(model, optimizer, format,
module_filter=...)`` converts them, so a single-format plan trains bitwise the same as
that call. ``"bf16"`` leaves a layer to the base recipe, as every layer the plan does not
name. The setup's recipe is named ``plan-<digest of the plan>``: a checkpoint loads only
into a setup of the same plan.

Under FSDP2 convert first, as for the FP8 recipes: ``plan.convert(model)``, then
``fully_shard``, then ``prepare(model, optimizer, plan)``, which keeps the converted
layers and has FSDP2 all-gather their weights in FP8 or FP4 where that is exact
(:mod:`amped.recipes.lowp_wire`). ``fully_shard`` wraps a module's class, so a layer it
was applied to cannot be converted in place afterwards.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from amped._internal.errors import type_error, value_error
from amped._internal.jsonio import from_json, to_json
from amped.lowp.attention_config import AttentionConfig, resolve_config
from amped.lowp.conv1d import is_linear_like, linear_dims
from amped.lowp.convert import LowPrecisionConfig, LowPrecisionLayers, convert_layers
from amped.lowp.float8.config import FLOAT8_CONFIGS
from amped.lowp.float8.linear import Float8Linear
from amped.lowp.mx.block_config import BLOCK_CONFIGS, BlockConfig
from amped.lowp.mx.block_linear import BlockLinear
from amped.optim.shards import fsdp_modules
from amped.recipes.attention import convert_model_attention
from amped.recipes.lowp_wire import install_low_precision_wire
from amped.recipes.registry import Recipe, resolve_recipe
from amped.recipes.setup import TrainSetup
from amped.recipes.weights import require_float32
from amped.scaling import GradScaler

__all__ = [
    "PLAN_FORMATS",
    "PLAN_SCHEMA",
    "PLAN_SCHEMA_ATTENTION",
    "PrecisionPlan",
    "format_config",
    "format_multiple",
]

PLAN_SCHEMA = "amped.tune/1"
"""The ``"schema"`` of a tuned.json whose plan has no attention config."""

PLAN_SCHEMA_ATTENTION = "amped.tune/2"
"""The ``"schema"`` of a tuned.json whose plan carries an attention config (its
``"attention"`` key): a reader that knows only ``amped.tune/1`` refuses it rather than
dropping the attention. :meth:`PrecisionPlan.load` reads both."""

PLAN_FORMATS = (
    "bf16",
    "fp8-tensorwise",
    "fp8-rowwise",
    "fp8-rowwise-gw-hp",
    "fp8-blockwise",
    "mxfp8",
    "mxfp4",
    "nvfp4",
)
"""What a plan may give a layer. ``fp8-delayed`` is left out: its scales come from the
history of earlier steps, which one layer's measurement cannot see."""

PLAN_BASES = ("bf16-mixed", "bf16-master", "bf16-pure", "bf16-pure-sr")
"""The bases a plan may name (those of the FP8 recipes)."""


def format_config(fmt: str) -> LowPrecisionConfig:
    """The named config of a low-precision plan format (ValueError for others)."""
    if fmt in BLOCK_CONFIGS:
        return BLOCK_CONFIGS[fmt]
    if fmt.startswith("fp8-") and fmt in PLAN_FORMATS:
        return FLOAT8_CONFIGS[fmt.removeprefix("fp8-")]
    raise value_error(
        f"A plan format is one of {', '.join(PLAN_FORMATS)} ('bf16' leaves the layer to "
        "the base recipe)",
        "format",
        fmt,
    )


def format_multiple(fmt: str) -> int:
    """What both dims of a layer must be multiples of to run in ``fmt``: 16 for the FP8
    GEMMs, lcm(16, block size) for the block formats; 1 for ``"bf16"``."""
    if fmt == "bf16":
        return 1
    config = format_config(fmt)
    if isinstance(config, BlockConfig):
        return math.lcm(16, config.format.block_size)
    return 16


def _shorten(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters (a hostile file's values can be huge)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _file_error(message: str, name: str, value: Any) -> ValueError:
    """A tuned.json's content that is not a plan: what was wrong, shortened."""
    return ValueError(
        f'A tuned.json\'s plan is {{"schema", "base", "layers"}}, and {message}. '
        f"Received: {name}={_shorten(value)} (of type {type(value).__name__})"
    )


def _attention_entry(entry: Any) -> AttentionConfig | None:
    """A tuned.json's ``"attention"``: None (absent or null) or a config's object."""
    if entry is None:
        return None
    try:
        return AttentionConfig.from_dict(entry)
    except ValueError as error:
        raise _file_error(
            'its "attention" is null or an attention config object (AttentionConfig.to_dict: '
            f"each of the roles s, o, dv, dp, dq, dk a rule such as 'e4m3/head' or null, "
            f"causal_safe, block_size), but {error}",
            "attention",
            entry,
        ) from None


def _is_fsdp_module(module: torch.nn.Module) -> bool:
    return any(m is module for m in fsdp_modules(module))


def layer_ineligibility(module: torch.nn.Module | None, fmt: str) -> str | None:
    """Why ``module`` cannot run in ``fmt``, or None when it can."""
    if module is None:
        return "the model has no module of that name"
    if isinstance(module, Float8Linear | BlockLinear):  # converted before fully_shard
        own = module.block_config if isinstance(module, BlockLinear) else module.float8_config
        if fmt == "bf16" or own != format_config(fmt):
            return (
                f"it is converted already, with other rules ({own}); convert a model "
                "with plan.convert(model)"
            )
        return None
    sharded_linear = isinstance(module, torch.nn.Linear) and _is_fsdp_module(module)
    if sharded_linear and fmt != "bf16":
        return (
            f"it is a {type(module).__name__}: fully_shard wrapped its class, and a sharded "
            "layer cannot be converted in place; under FSDP2 call plan.convert(model) "
            "before fully_shard (docs/distributed.md)"
        )
    if not is_linear_like(module) and not sharded_linear:
        return f"it is a {type(module).__name__}, not an nn.Linear or transformers Conv1D"
    multiple = format_multiple(fmt)
    fan_in, fan_out = linear_dims(module)
    if fan_in % multiple or fan_out % multiple:
        return f"its dims {fan_in}x{fan_out} are not multiples of {multiple}"
    return None


@dataclasses.dataclass(frozen=True)
class PrecisionPlan:
    """A format per Linear layer over one base recipe, and optionally an attention config.

    Attributes:
        base: the recipe that keeps weights and optimizer state and runs everything
            else (``bf16-mixed``, ``bf16-master``, ``bf16-pure``, ``bf16-pure-sr``).
        layers: module name -> format (one of :data:`PLAN_FORMATS`), in model order.
        attention: the config the model's attention runs in, as
            ``prepare(..., attention=config)`` converts it (a preset name is stored
            resolved); None: the attention is left as it is.
    """

    base: str
    layers: Mapping[str, str]
    attention: AttentionConfig | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.layers, Mapping):
            raise type_error("layers maps module names to formats", "layers", self.layers)
        if self.attention is not None:
            object.__setattr__(self, "attention", resolve_config(self.attention))
        chosen = resolve_recipe(self.base)
        if chosen.name not in PLAN_BASES:
            raise value_error(f"A plan's base is one of {', '.join(PLAN_BASES)}", "base", self.base)
        object.__setattr__(self, "base", chosen.name)
        object.__setattr__(self, "layers", dict(self.layers))
        for name, fmt in self.layers.items():
            if not isinstance(name, str):
                raise type_error("A plan's layer names are strings", "layer name", name)
            if not isinstance(fmt, str):
                raise type_error(
                    f"A plan's formats are strings, one of {', '.join(PLAN_FORMATS)} "
                    f"(layer {name!r})",
                    "format",
                    fmt,
                )
            if fmt != "bf16":
                format_config(fmt)  # raises for an unknown format

    def lowered(self) -> dict[str, str]:
        """The layers the plan runs in a low-precision format (not ``"bf16"``)."""
        return {name: fmt for name, fmt in self.layers.items() if fmt != "bf16"}

    def to_dict(self) -> dict[str, Any]:
        """``{"schema", "base", "layers"}``: the plan part of a tuned.json; with an
        attention config also ``"attention"`` (:meth:`AttentionConfig.to_dict`), under
        :data:`PLAN_SCHEMA_ATTENTION`."""
        if self.attention is None:
            return {"schema": PLAN_SCHEMA, "base": self.base, "layers": dict(self.layers)}
        return {
            "schema": PLAN_SCHEMA_ATTENTION,
            "base": self.base,
            "layers": dict(self.layers),
            "attention": self.attention.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PrecisionPlan:
        """The plan of a tuned.json's content (its other keys are ignored); a missing or
        null ``"attention"`` is no attention config (tuned.json files written before
        attention was tuned have none)."""
        schemas = (PLAN_SCHEMA, PLAN_SCHEMA_ATTENTION)
        if not isinstance(data, Mapping) or data.get("schema") not in schemas:
            schema = data.get("schema") if isinstance(data, Mapping) else None
            raise value_error(
                f"A plan is read from a tuned.json with schema {PLAN_SCHEMA!r} or "
                f"{PLAN_SCHEMA_ATTENTION!r} (written by amped.tune or `amped tune`)",
                "schema",
                schema,
            )
        base, layers = data.get("base", ""), data.get("layers", {})
        if not isinstance(base, str):
            raise _file_error(
                f'its "base" is a recipe name string, one of {", ".join(PLAN_BASES)}', "base", base
            )
        if not isinstance(layers, Mapping):
            raise _file_error(
                'its "layers" is a JSON object mapping module names to formats', "layers", layers
            )
        for name, fmt in layers.items():
            if not isinstance(fmt, str):
                raise _file_error(
                    f"layer {_shorten(name)} has no format string; a format is one of "
                    f"{', '.join(PLAN_FORMATS)}",
                    "format",
                    fmt,
                )
        if data["schema"] == PLAN_SCHEMA and data.get("attention") is not None:
            raise _file_error(
                f'its schema is {PLAN_SCHEMA!r}, which has no "attention" (a plan with an '
                f"attention config is {PLAN_SCHEMA_ATTENTION!r}); write it again with "
                "PrecisionPlan.save or amped.tune",
                "attention",
                data["attention"],
            )
        return cls(base, layers, _attention_entry(data.get("attention")))

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write :meth:`to_dict` as JSON to ``path``; returns the path."""
        out = Path(path)
        out.write_text(to_json(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        return out

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PrecisionPlan:
        """Read a plan from a tuned.json (or a file :meth:`save` wrote).

        JSON only: nothing in the file runs code.

        Raises:
            ValueError: the file cannot be read, is not UTF-8 JSON, nests too deeply, or
                is not a plan (another schema, a base or format that is not a name, an
                unknown one); the message says what and names the file.
        """
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as error:
            raise value_error(
                f"Could not read the plan file ({error.strerror}); pass the path of a tuned.json",
                "path",
                str(path),
            ) from None
        except UnicodeDecodeError as error:
            raise value_error(
                f"The plan file is not UTF-8 text (byte {error.start}: {error.reason}); pass "
                "the path of a tuned.json",
                "path",
                str(path),
            ) from None
        try:
            data = from_json(text)
        except json.JSONDecodeError as error:
            raise value_error(
                f"The plan file is not JSON ({error.msg} at line {error.lineno})",
                "path",
                str(path),
            ) from None
        except RecursionError:
            # A tuned.json nests two levels; json's parser recurses once per level.
            raise value_error(
                "The plan file nests its JSON too deeply to read (a tuned.json nests a few "
                "levels); pass the path of a tuned.json",
                "path",
                str(path),
            ) from None
        except ValueError as error:  # e.g. an integer past int's digit limit
            raise value_error(
                f"The plan file is not a JSON amped can read ({error})", "path", str(path)
            ) from None
        try:
            return cls.from_dict(data)
        except ValueError as error:
            raise ValueError(f"The plan file {str(path)!r} is not a valid plan: {error}") from None

    def convert(self, model: torch.nn.Module) -> LowPrecisionLayers | None:
        """Convert ``model``'s layers to the plan's formats in place, as ``prepare``
        does (under FSDP2: before ``fully_shard``; ``prepare`` keeps them). Returns the
        converted layers (None when the plan lowers none); layers converted before with
        the same format are kept.

        Raises:
            ValueError: a layer the plan cannot give its format (see ``prepare``).
        """
        device_type = next((p.device.type for p in model.parameters()), "cpu")
        check_plan(self, model, device_type, None, set())
        return _convert(self, model)

    def digest(self) -> str:
        """Eight hex digits naming this plan (its base and layers)."""
        parts: list[Any] = [self.base, sorted(self.layers.items())]
        if self.attention is not None:  # plans without one keep their earlier digest
            parts.append(self.attention.to_dict())
        text = json.dumps(parts)
        return hashlib.sha256(text.encode()).hexdigest()[:8]


def check_plan(
    plan: PrecisionPlan,
    model: torch.nn.Module,
    device_type: str,
    scaler: GradScaler | None,
    ruled: set[str],
) -> None:
    """Refuse a plan that names a layer ``model`` lacks, one its format cannot run
    (not a Linear/Conv1D, dims not multiples), or one a policy module rule keeps out;
    with a lowered layer, also what the FP8 recipes refuse (a device other than cpu and
    cuda, weights not float32, a loss scaler)."""
    if plan.lowered():
        if device_type not in ("cpu", "cuda"):
            raise value_error(
                "A plan's low-precision layers run on cpu (emulated) and cuda; move the "
                "model to one of them",
                "device_type",
                device_type,
            )
        require_float32(model, "A plan casts float32 weights to its layers' formats")
        if scaler is not None and scaler.is_enabled():
            raise value_error(
                "A plan does not scale the loss (its base is a bfloat16 recipe, and FP8 and "
                "block casts have their own scales); pass no scaler",
                "scaler.is_enabled()",
                True,
            )
    modules = dict(model.named_modules())
    for name, fmt in plan.layers.items():
        why = layer_ineligibility(modules.get(name), fmt)
        if why is None and fmt != "bf16" and name in ruled:
            why = "a module rule of the policy keeps it out of low precision"
        if why is not None:
            raise value_error(
                f"The plan gives layer {name!r} the format {fmt!r}, but {why}; a plan names "
                "nn.Linear/Conv1D layers of this model by their qualified names "
                "(model.named_modules()). Tune this model again, or edit the plan",
                name,
                fmt,
            )


def plan_recipe(plan: PrecisionPlan) -> Recipe:
    """The recipe a plan's setup reports: the base's weights, named by the plan's digest."""
    base = resolve_recipe(plan.base)
    return dataclasses.replace(
        base,
        name=f"plan-{plan.digest()}",
        aliases=(),
        summary=f"a tuned per-layer plan over {base.name}",
    )


def apply_plan(plan: PrecisionPlan, setup: TrainSetup) -> TrainSetup:
    """Convert the plan's lowered layers of the base recipe's ``setup`` in place.

    Layers of one format convert together, in model order (the seeds of stochastic
    rounding and Hadamard signs follow that order, as ``convert_to_low_precision`` gives them).
    """
    converted = _convert(plan, setup.model)
    if converted is not None:
        setup.low_precision_layers = converted
        setup.low_precision_base = plan.base
        install_low_precision_wire(setup.model, converted)  # FSDP2: FP8 or FP4 weights on the wire
    if plan.attention is not None:  # as prepare(..., attention=plan.attention) converts
        setup.attention = convert_model_attention(setup.model, plan.attention)
    setup.recipe = plan_recipe(plan)
    return setup


def _convert(plan: PrecisionPlan, model: torch.nn.Module) -> LowPrecisionLayers | None:
    """Convert the plan's lowered layers of ``model`` not converted yet, one format at a
    time in model order (the seeds of stochastic rounding and Hadamard signs follow that
    order, as ``convert_to_low_precision`` gives them); None when the plan lowers no layer."""
    modules = dict(model.named_modules())
    order = list(modules)
    lowered = plan.lowered()
    layers: dict[str, Any] = {}
    first_config: LowPrecisionConfig | None = None
    for fmt in dict.fromkeys(lowered[name] for name in order if name in lowered):
        names = [name for name in order if lowered.get(name) == fmt]
        config = format_config(fmt)
        fresh = [n for n in names if not isinstance(modules[n], Float8Linear | BlockLinear)]
        layers.update({n: modules[n] for n in names if n not in fresh})
        if fresh:
            layers.update(convert_layers(model, config, fresh).layers)
        first_config = first_config or config
    if first_config is None:
        return None
    # No plan format has delayed scaling, so update() is a no-op whatever the config.
    return LowPrecisionLayers({n: layers[n] for n in order if n in layers}, first_config)
