"""The part of a framework plugin that does not depend on the framework: arguments,
the setup, the forward context, the recipe's state, teardown. Imports no framework."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

import amped
from amped._internal.errors import received, value_error
from amped._internal.trees import map_tensors
from amped.autocast_mode import autocast
from amped.integrations.common import default_scaler, resolve_arguments
from amped.policy import Policy
from amped.recipes import Recipe, TrainSetup, memory_report
from amped.recipes.memory import MemoryReport
from amped.recipes.setup import check_recipe_state
from amped.scaling import GradScaler

__all__ = ["RecipeDriver", "to_dtype"]


class RecipeDriver:
    """What a framework plugin shares: its arguments (checked at construction), the
    :class:`~amped.recipes.TrainSetup` it builds, the forward context, the recipe's state
    (loaded before the setup exists too) and teardown."""

    recipe: Recipe
    policy: Policy | None
    device: str
    scaler: GradScaler
    setup: TrainSetup | None
    _pending_state: dict[str, Any] | None

    def _init_recipe(
        self,
        recipe: str | Recipe,
        policy: Policy | str | None,
        device: str | None,
        scaler: GradScaler | None,
    ) -> None:
        self.recipe, self.policy, self.device = resolve_arguments(recipe, policy, device)
        self.scaler = default_scaler(self.recipe, self.device, scaler)
        self.setup = None
        self._pending_state = None

    def _prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainSetup:
        if self.setup is not None and self.setup.installed is not None:
            raise RuntimeError(
                f"This plugin already runs recipe {self.recipe.name!r} on a model; use one "
                "plugin per model (or call teardown() first). "
                + received("type(model)", type(model))
            )
        types = {p.device.type for p in model.parameters()}
        if types and types != {self.device}:
            raise value_error(
                f"The plugin was built for device {self.device!r} but the model is on "
                f"{sorted(types)}; pass device= to match",
                "device",
                self.device,
            )
        self.setup = amped.prepare(
            model, optimizer, self.recipe, policy=self.policy, scaler=self.scaler
        )
        if self._pending_state is not None:
            self.setup.load_recipe_state_dict(self._pending_state)
            self._pending_state = None
        return self.setup

    def _require_setup(self, optimizer: Any) -> TrainSetup:
        setup = self.setup
        if setup is None or optimizer is not setup.optimizer:
            raise RuntimeError(
                f"Recipe {self.recipe.name!r} steps the optimizer amped prepared "
                "(Fabric: pass precision.prepare(model, optimizer)'s results to "
                "fabric.setup; Lightning: one optimizer from configure_optimizers). "
                + received("type(optimizer)", type(optimizer))
            )
        return setup

    def _forward_context(self) -> contextlib.AbstractContextManager[Any]:
        if self.setup is not None:
            return self.setup.autocast()
        if not self.recipe.autocast:
            return contextlib.nullcontext()
        return autocast(self.device, dtype=self.recipe.dtype, policy=self.policy)

    def memory_report(self) -> MemoryReport:
        """:func:`amped.memory_report` of the model and optimizer the recipe trains."""
        if self.setup is None:
            raise RuntimeError("memory_report() needs a prepared model; call it during fit.")
        return memory_report(self.setup.model, self.setup.optimizer)

    def _state_dict(self) -> dict[str, Any]:
        if self.setup is None:
            return {"recipe": self.recipe.name, "scaler": self.scaler.state_dict()}
        return self.setup.recipe_state_dict()

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        if self.setup is not None:
            self.setup.load_recipe_state_dict(state)
            return
        check_recipe_state(state, self.recipe)
        # The scaler scales the next backward, possibly before the setup exists.
        self.scaler.load_state_dict(state["scaler"])
        if "masters" in state:
            self._pending_state = state

    def _teardown(self) -> None:
        if self.setup is not None:
            self.setup.teardown()


def to_dtype(data: Any, dtype: torch.dtype) -> Any:
    """Floating tensors in ``data`` (nested in lists, tuples, namedtuples and dicts) cast
    to ``dtype``; other tensors and leaves as they are."""
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, data)
