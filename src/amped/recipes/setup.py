"""``amped.prepare``: turn a model and an optimizer into a training setup for a recipe.

The setup owns what the loop needs, so one loop serves every recipe::

    setup = amped.prepare(model, optimizer, recipe="bf16-mixed")
    for x, y in batches:
        with setup.autocast():
            loss = loss_fn(setup.model(x), y)
        setup.backward(loss)
        setup.step()
        setup.zero_grad()
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch

from amped._internal.torch_compat import dtensor_class
from amped.autocast_mode import autocast
from amped.fp8 import Fp8Layers, ModuleFilter
from amped.policy import Policy
from amped.recipes.registry import Recipe, resolve_recipe
from amped.recipes.weights import Lowering, installed_on, restore_model_
from amped.scaling import GradScaler

__all__ = ["TrainSetup", "prepare"]


class TrainSetup:
    """A model, the optimizer to step, the autocast region and the scaler of one recipe.

    Attributes:
        recipe: the :class:`~amped.recipes.Recipe` in use.
        model: the model to call (for weight-changing recipes, the converted one).
        optimizer: the optimizer :meth:`step` steps.
        scaler: a :class:`~amped.GradScaler`, enabled only for loss-scaling recipes.
        device_type: where the model's parameters live.
        policy: the autocast policy (None for torch's default).
        fp8_layers: for the FP8 recipes, the layers converted to FP8 (else None).
    """

    fp8_layers: Fp8Layers | None = None

    def __init__(
        self,
        recipe: Recipe,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: GradScaler,
        device_type: str,
        policy: Policy | None = None,
    ) -> None:
        self.recipe = recipe
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        self.device_type = device_type
        self.policy = policy

    # --- hooks for the weight-changing recipes (no-ops here) --------------------------

    def _prepare_grads(self) -> None:
        """Put the gradients where the optimizer reads them (O2: into the masters)."""

    def _after_step(self, stepped: bool) -> None:
        """Runs after every :meth:`step`, stepped or skipped."""

    # --- the loop ----------------------------------------------------------------------

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The region to run the forward pass and the loss in."""
        if not self.recipe.autocast:
            return contextlib.nullcontext()
        return autocast(self.device_type, dtype=self.recipe.dtype, policy=self.policy)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, with the loss scaled when the recipe scales it."""
        self.scaler.scale(loss).backward()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Unscale the gradients the optimizer steps on, and clip their total norm.

        Use it between :meth:`backward` and :meth:`step`: it clips the float32 master
        gradients under O2 and the unscaled ones under fp16 recipes, which clipping
        ``model.parameters()`` would miss. Returns the total norm before clipping.
        No sync (``torch.nn.utils.clip_grad_norm_`` does not read it on the host).
        """
        self._prepare_grads()
        self.scaler.unscale_(self.optimizer)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    def step(self) -> bool:
        """Step the optimizer (unless the gradients overflowed) and update the scale.

        Returns True if the optimizer stepped. Syncs with the device once when the
        recipe scales the loss (the inf/NaN check); never otherwise.
        """
        self._prepare_grads()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        stepped = not self.scaler.last_step_skipped
        self._after_step(stepped)
        if self.fp8_layers is not None:
            self.fp8_layers.update()  # delayed scaling's histories and next scales
        return stepped

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients and the optimizer's (masters' included)."""
        self.model.zero_grad(set_to_none=set_to_none)
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer and scaler state, at full precision where the recipe keeps it.

        Loading it back with :meth:`load_state_dict` restores every tensor bitwise.
        """
        return {
            "recipe": self.recipe.name,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` written by a setup of the same recipe."""
        self._check_recipe(state)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])

    def fp32_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict in float32, at the best precision the recipe holds.

        For a plain float32 model (export, evaluation, a fine-tune without amped):
        O2 gives its float32 masters, bf16-pure its weights plus their Kahan
        compensation; the others, the model's own weights.
        """
        return {
            k: v.to(torch.float32) if v.is_floating_point() else v
            for k, v in self.model.state_dict().items()
        }

    def _check_recipe(self, state: dict[str, Any]) -> None:
        if state.get("recipe") != self.recipe.name:
            raise ValueError(
                f"This checkpoint was written by recipe {state.get('recipe')!r}, this setup "
                f"runs {self.recipe.name!r}. Received: recipe={state.get('recipe')!r}"
            )

    # --- what training frameworks drive (amped.integrations) ---------------------------

    @property
    def installed(self) -> Lowering | None:
        """What :func:`prepare` installed on the model (lowered weights and buffers, the
        input-casting hook), or None when the recipe leaves the model as it is."""
        return installed_on(self.model)

    def unscale_(self) -> None:
        """Put the gradients where the optimizer reads them and unscale them, once per step.

        For clipping or inspecting gradients before :meth:`step` (which then does not
        unscale again). No sync.
        """
        self._prepare_grads()
        self.scaler.unscale_(self.optimizer)

    def main_params(self, params: Iterable[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The tensors the optimizer steps, whose gradients clipping must see: the float32
        masters under O2, the model's parameters otherwise.

        Args:
            params: model parameters to map, in their order (clipping sums the norms in
                it); by default every parameter the optimizer steps, in its order.
        """
        if params is not None:
            return list(params)
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def model_state_dict(self) -> dict[str, Any]:
        """The model's entry of :meth:`state_dict`: what a framework saves as the model."""
        return self.model.state_dict()

    def recipe_state_dict(self) -> dict[str, Any]:
        """What the recipe keeps beside the model and optimizer state: its name and the
        scaler (strategy, scale, counters). Syncs when the scaler is enabled."""
        return {"recipe": self.recipe.name, "scaler": self.scaler.state_dict()}

    def load_recipe_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`recipe_state_dict`."""
        self._check_recipe(state)
        self.scaler.load_state_dict(state["scaler"])

    def teardown(self) -> None:
        """Remove what :func:`prepare` installed and give the model float32 weights back.

        The autocast recipes installed nothing. O2 puts each float32 master back as its
        parameter's data and the masters back under the user's optimizer; bf16-pure puts
        back each weight plus its compensation in float32 (the original float32 weights
        were not kept: that is the memory the recipe saves). Lowered buffers get their
        original float32 tensor back when training left them unchanged, a float32 copy
        otherwise. The input-casting hook is removed. Idempotent.
        """
        self._restore_weights()
        restore_model_(self.model)

    def _restore_weights(self) -> None:
        """Give lowered parameters float32 data again (weight-changing recipes)."""

    def __repr__(self) -> str:
        return f"TrainSetup(recipe={self.recipe.name!r}, device_type={self.device_type!r})"


def _device_type(model: torch.nn.Module) -> str:
    devices = {p.device.type for p in model.parameters()}
    if len(devices) != 1:
        raise ValueError(
            "prepare() needs a model whose parameters are all on one device type. "
            f"Received: parameters on {sorted(devices) or 'no device (no parameters)'}"
        )
    return devices.pop()


def _check_optimizer(model: torch.nn.Module, optimizer: object) -> torch.optim.Optimizer:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "prepare() takes a torch.optim.Optimizer over the model's parameters. "
            f"Received: optimizer={optimizer!r} (of type {type(optimizer).__name__})"
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


def _check_float32(model: torch.nn.Module, recipe: Recipe) -> None:
    dtensor = dtensor_class()
    for name, param in model.named_parameters():
        if dtensor is not None and isinstance(param, dtensor):
            # Lowering a DTensor changes its metadata, not FSDP2's float32 local shards.
            raise ValueError(
                f"Recipe {recipe.name!r} lowers the model's weights, but its parameters are "
                "DTensors (sharded by fully_shard, or tensor parallel); lowering one leaves "
                "the float32 shards FSDP2 keeps. For master weights under FSDP2, pass mp_policy="
                "MixedPrecisionPolicy(param_dtype=..., reduce_dtype=torch.float32) to "
                "fully_shard (the float32 shards are the masters) and use a '-mixed' "
                "recipe; see the README's 'Distributed' section. "
                f"Received: parameter {name!r} of type {type(param).__name__}"
            )
        if param.is_floating_point() and param.dtype is not torch.float32:
            raise ValueError(
                f"Recipe {recipe.name!r} lowers a float32 model's weights itself (and keeps "
                "float32 copies where it needs them); pass the model in float32. "
                f"Received: parameter {name!r} of dtype {param.dtype}"
            )


_BUILDERS: dict[str, Callable[..., TrainSetup]] = {}


def register_builder(weights: str, builder: Callable[..., TrainSetup]) -> None:
    """Let a module that implements a weight-changing recipe family build its setups."""
    _BUILDERS[weights] = builder


def prepare(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    recipe: str | Recipe = "bf16-mixed",
    *,
    policy: Policy | str | None = None,
    scaler: GradScaler | None = None,
    base: str | Recipe | None = None,
    module_filter: ModuleFilter | None = None,
) -> TrainSetup:
    """Turn ``model`` and ``optimizer`` into a :class:`TrainSetup` for ``recipe``.

    The autocast recipes (``fp32``, ``bf16-mixed``, ``fp16-mixed``) leave model and
    optimizer as they are. The others change them in place: ``*-master`` lowers the
    weights (except modules the policy keeps in float32; norms by default) and puts
    float32 masters under the optimizer (``setup.optimizer`` is a
    :class:`~amped.recipes.MasterWeightOptimizer`); ``bf16-pure*`` lowers every weight
    and replaces SGD/Adam/AdamW by its compensated twin (``setup.optimizer``). Always
    step ``setup.optimizer``, through :meth:`TrainSetup.step`.

    Args:
        model: the model, on its device, in float32.
        optimizer: a ``torch.optim`` optimizer built over ``model.parameters()``.
        recipe: a recipe name or alias (see :data:`amped.recipes.RECIPES`).
        policy: the autocast policy (an :class:`amped.Policy` or preset name).
        scaler: a GradScaler to use instead of the recipe's default one.
        base: FP8 recipes only: the recipe that keeps weights and optimizer state
            (``bf16-mixed`` by default, ``bf16-master``, ``bf16-pure``, ``bf16-pure-sr``).
        module_filter: FP8 recipes only: ``filter(linear, name) -> bool`` choosing the
            ``nn.Linear`` layers to convert (default: :func:`amped.fp8.default_module_filter`).

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
    chosen = resolve_recipe(recipe)
    if chosen.fp8 is None and (base is not None or module_filter is not None):
        raise ValueError(
            f"base and module_filter apply to the FP8 recipes only; {chosen.name!r} is not "
            f"one. Received: base={base!r}, module_filter={module_filter!r}"
        )
    device_type = _device_type(model)
    optimizer = _check_optimizer(model, optimizer)
    if isinstance(policy, str):
        policy = Policy.preset(policy, device_type)
    if scaler is None:
        scaler = GradScaler(device_type, enabled=chosen.loss_scaling)
    if chosen.fp8 is not None:
        return _BUILDERS["fp8"](
            chosen, model, optimizer, scaler, device_type, policy, base, module_filter
        )
    if chosen.weights != "fp32":
        _check_float32(model, chosen)
    builder = _BUILDERS.get(chosen.weights)
    if builder is not None:
        return builder(chosen, model, optimizer, scaler, device_type, policy)
    return TrainSetup(chosen, model, optimizer, scaler, device_type, policy)
