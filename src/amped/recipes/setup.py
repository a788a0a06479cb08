"""``TrainSetup``: what the training loop drives, the same for every recipe.

:func:`amped.prepare` (:mod:`.build`) builds one; the setup owns what the loop needs,
so one loop serves every recipe::

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
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from amped._internal.errors import value_error
from amped.autocast_mode import autocast
from amped.lowp.convert import LowPrecisionLayers
from amped.optim.in_backward import in_backward
from amped.policy import Policy
from amped.recipes.attention import AttentionConversion
from amped.recipes.registry import Recipe
from amped.recipes.weights import Lowering, installed_on, restore_model_
from amped.scaling import GradScaler

__all__ = ["TrainSetup", "check_recipe_state"]


def _deprecated(old: str, new: str) -> None:
    warnings.warn(
        f"TrainSetup.{old} is deprecated and will be removed in the next release; "
        f"use TrainSetup.{new}",
        DeprecationWarning,
        stacklevel=3,
    )


class TrainSetup:
    """A model, the optimizer to step, the autocast region and the scaler of one recipe.

    Attributes:
        recipe: the :class:`~amped.recipes.Recipe` in use.
        model: the model to call (for weight-changing recipes, the converted one).
        optimizer: the optimizer :meth:`step` steps.
        scaler: a :class:`~amped.GradScaler`, enabled only for loss-scaling recipes.
        device_type: where the model's parameters live.
        policy: the autocast policy (None for torch's default).
        low_precision_layers: for the FP8 and block recipes, the converted layers (else
            None).
        low_precision_base: for the FP8 and block recipes, the name of the base recipe
            (else None).
        attention: with ``prepare(..., attention=...)``, the attention config and the
            attention modules it could not convert, with the reason (else None).
    """

    low_precision_layers: LowPrecisionLayers | None = None
    low_precision_base: str | None = None
    attention: AttentionConversion | None = None
    monitor: Any = None  # an amped.recipes.monitoring.Monitor (amped.monitor attaches it)

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

    # rewrite: keep-start (the old spellings, deprecated)
    @property
    def fp8_layers(self) -> LowPrecisionLayers | None:
        """Deprecated: :attr:`low_precision_layers` (removed in the next release)."""
        _deprecated("fp8_layers", "low_precision_layers")
        return self.low_precision_layers

    @fp8_layers.setter
    def fp8_layers(self, layers: LowPrecisionLayers | None) -> None:
        _deprecated("fp8_layers", "low_precision_layers")
        self.low_precision_layers = layers

    @property
    def fp8_base(self) -> str | None:
        """Deprecated: :attr:`low_precision_base` (removed in the next release)."""
        _deprecated("fp8_base", "low_precision_base")
        return self.low_precision_base

    @fp8_base.setter
    def fp8_base(self, base: str | None) -> None:
        _deprecated("fp8_base", "low_precision_base")
        self.low_precision_base = base

    # rewrite: keep-end

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
        """``loss.backward()``, with the loss scaled when the recipe scales it.

        Raises:
            ValueError: the loss is scaled (an enabled scaler) and the optimizer steps
                in backward (:func:`amped.optim.step_in_backward`), which would step
                every parameter on its scaled gradient, unchecked for inf/NaN.
        """
        if self.scaler.is_enabled() and in_backward(self.optimizer):
            raise value_error(
                "step_in_backward steps each parameter inside backward, on its scaled "
                "gradient, before the GradScaler can unscale it or skip an inf/NaN step: "
                "loss scaling cannot run under it. Step in backward without a scaler (the "
                "bf16-pure recipes need none), or remove the hooks (hooks.remove())",
                "scaler.is_enabled()",
                True,
            )
        if self.monitor is not None:
            self.monitor.observe_loss(loss)
        self.scaler.scale(loss).backward()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Unscale the gradients the optimizer steps on, and clip their total norm.

        Use it between :meth:`backward` and :meth:`step`: it clips the float32 master
        gradients under O2 and the unscaled ones under fp16 recipes, which clipping
        ``model.parameters()`` would miss. Returns the total norm before clipping.
        No sync (``torch.nn.utils.clip_grad_norm_`` does not read it on the host).
        """
        self.unscale_()
        return torch.nn.utils.clip_grad_norm_(self.main_params(), max_norm, norm_type)

    def step(self) -> bool:
        """Step the optimizer (unless the gradients overflowed) and update the scale.

        Returns True if the optimizer stepped. Syncs with the device once when the
        recipe scales the loss (the inf/NaN check); never otherwise.
        """
        self._prepare_grads()
        monitor = self.monitor
        if monitor is not None and not monitor.check_step():  # one sync; may raise
            monitor.skip_step()
            self._after_step(False)
            monitor.end_step()
            return False
        self.scaler.step(self.optimizer)
        self.scaler.update()
        stepped = not self.scaler.last_step_skipped
        self._after_step(stepped)
        if self.low_precision_layers is not None:
            self.low_precision_layers.update()  # delayed scaling's histories and next scales
        if monitor is not None:
            monitor.end_step()
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
            **self._identity(),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` written by a setup of the same recipe (and, for
        the FP8 recipes, the same base recipe and FP8 config)."""
        self.check_state(state)
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
        return {**self._identity(), "scaler": self.scaler.state_dict()}

    def load_recipe_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`recipe_state_dict`."""
        self.check_state(state)
        self.scaler.load_state_dict(state["scaler"])

    def _identity(self) -> dict[str, Any]:
        """What a state this setup writes must match to load: the recipe's name, and for
        the FP8 recipes the base recipe and the FP8 config."""
        identity: dict[str, Any] = {"recipe": self.recipe.name}
        if self.low_precision_layers is not None:
            identity["fp8"] = {
                "base": self.low_precision_base,
                "config": str(self.low_precision_layers.config),
            }
        return identity

    def check_state(self, state: dict[str, Any]) -> None:
        """Refuse a state written by another recipe, or by an FP8 recipe over another base
        or with another FP8 config (the error names both).

        Raises:
            ValueError: the state does not belong to this setup's recipe.
        """
        check_recipe_state(state, self.recipe)
        mine, theirs = self._identity().get("fp8"), state.get("fp8")
        if mine is None or theirs is None or mine == theirs:
            return  # (a state from before amped recorded the base loads as it did)
        raise value_error(
            f"This state was written by recipe {self.recipe.name!r} over base "
            f"{theirs.get('base')!r} with FP8 config {theirs.get('config')!r}; this setup "
            f"runs it over base {mine['base']!r} with FP8 config {mine['config']!r}. Weights "
            "and optimizer state differ between bases (bf16-pure keeps a compensation, "
            "bf16-master float32 masters), so it would load wrong or fail at the next "
            f"step. Prepare with base={theirs.get('base')!r} to resume it",
            "state['fp8']",
            theirs,
        )

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


def check_recipe_state(state: dict[str, Any], recipe: Recipe) -> None:
    """Refuse a checkpoint or recipe state that another recipe wrote."""
    saved = state.get("recipe")
    if saved != recipe.name:
        raise value_error(
            f"This state was written by recipe {saved!r}, this setup runs {recipe.name!r}; "
            "load it where that recipe runs",
            "state['recipe']",
            saved,
        )
