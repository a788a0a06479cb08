"""An Accelerate ``Accelerator`` that runs an amped recipe.

Accelerate has no registry of precision plugins: its mixed precision is wired into
``Accelerator`` itself. So amped subclasses it; the training loop stays Accelerate's::

    from amped.integrations.accelerate import Accelerator
    accelerator = Accelerator(recipe="bf16-master")       # instead of mixed_precision=
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    for x, y in loader:
        loss = loss_fn(model(x), y)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)   # the masters under O2
        optimizer.step()                                       # skipped on overflow
        scheduler.step()                                       # skips with it
        optimizer.zero_grad()

``prepare`` runs :func:`amped.prepare` on the model and its optimizer, then
Accelerate's own ``prepare``: the model's forward runs in the recipe's autocast region
(outputs converted to float32, as Accelerate does), ``backward`` scales the loss when
the recipe scales it, the optimizer steps through the recipe (unscale, skip on
overflow, masters copied back) and ``optimizer_step_was_skipped`` says whether it
skipped. ``save_state``/``load_state`` carry the scaler (``scaler.pt``, as Accelerate
writes it) and what else the recipe keeps (O2's float32 masters) bitwise. The recipe's
state travels in amped's own file, ``amped_recipe_state.pt`` (written with
:func:`amped.checkpoint.save_checkpoint`, read with :func:`amped.checkpoint.load_checkpoint`:
checked whole, then ``torch.load(weights_only=True)``), never in Accelerate's
``custom_checkpoint_<n>.pkl``, which Accelerate unpickles with torch's full unpickler:
a crafted file there would run code.

Requires ``accelerate`` (from amped's clone: ``pip install -e ".[accelerate]"``);
``import amped`` never imports it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from collections.abc import Generator
from pathlib import Path
from types import MethodType
from typing import Any

import accelerate
import torch
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import convert_outputs_to_fp32

import amped
from amped._internal.errors import received, type_error, value_error
from amped.autocast_mode import autocast
from amped.checkpoint.save_load import (
    CheckpointError,
    load_checkpoint,
    refuse_nonfinite,
    save_checkpoint,
)
from amped.integrations.common import default_scaler, rebind_scheduler, resolve_arguments
from amped.integrations.health import health_metrics
from amped.policy import Policy
from amped.recipes import Recipe, TrainSetup, memory_report, monitor
from amped.recipes.memory import MemoryReport
from amped.recipes.monitoring import Monitor
from amped.scaling import GradScaler

__all__ = ["RECIPE_STATE_NAME", "Accelerator", "RecipeState"]

RECIPE_STATE_NAME = "amped_recipe_state.pt"
"""The file, in each ``save_state`` folder, that holds the recipe's state."""

_CUSTOM_CHECKPOINT = re.compile(r"^custom_checkpoint_\d+\.pkl$")  # as Accelerate names them


class Accelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` with an amped recipe in place of ``mixed_precision``.

    Args:
        *args: Accelerate's arguments (not ``mixed_precision``: the recipe says it).
        recipe: a recipe name or alias (see :data:`amped.recipes.registry.RECIPES`).
        policy: the autocast policy, an :class:`amped.Policy` for this accelerator's
            device or a preset name.
        scaler: an :class:`amped.GradScaler` to use instead of the recipe's default.
        allow_nonfinite: ``save_state`` writes model weights or optimizer state holding
            an inf or NaN; by default it raises :class:`amped.checkpoint.CheckpointError`
            naming the first such tensor, before anything is written.
        **kwargs: Accelerate's keyword arguments.

    Raises:
        ValueError: an unknown recipe, ``mixed_precision`` given too, or a policy built
            for another device than the accelerator's.

    Single process, one model and one optimizer per ``prepare`` call for the
    weight-changing recipes (DeepSpeed and FSDP keep their own precision).
    """

    def __init__(
        self,
        *args: Any,
        recipe: str | Recipe = "bf16-mixed",
        policy: Policy | str | None = None,
        scaler: GradScaler | None = None,
        allow_nonfinite: bool = False,
        **kwargs: Any,
    ) -> None:
        chosen, _, _ = resolve_arguments(recipe, None, "cpu")  # unknown recipes fail first
        mixed = kwargs.pop("mixed_precision", None)
        if mixed not in (None, "no"):
            raise value_error(
                "amped's Accelerator takes recipe= instead of mixed_precision= (the recipe "
                "says the dtype); drop mixed_precision",
                "mixed_precision",
                mixed,
            )
        super().__init__(*args, mixed_precision="no", **kwargs)
        self.recipe, self.policy, self.device_type = resolve_arguments(
            chosen, policy, self.device.type
        )
        self.recipe_scaler = default_scaler(self.recipe, self.device_type, scaler)
        # Accelerate and the transformers Trainer save and load `scaler` (scaler.pt).
        self.scaler = self.recipe_scaler if self.recipe_scaler.is_enabled() else None
        self.setup: TrainSetup | None = None
        self.recipe_state = RecipeState(self)
        # Not register_for_checkpointing: Accelerate unpickles those files with
        # the full unpickler. The recipe's state goes through amped's own file instead.
        self.allow_nonfinite = allow_nonfinite
        self.register_save_state_pre_hook(self._save_recipe_state)
        self.register_load_state_pre_hook(self._read_recipe_state)
        self._loaded_recipe_state: dict[str, Any] | None = None
        self.health: Monitor | None = None

    def monitor(
        self,
        every: int = 50,
        *,
        on_nonfinite: str = "skip",
        strict: bool = False,
        record: str | Path | None = None,
    ) -> Monitor:
        """Attach :func:`amped.monitor` to the prepared setup (after :meth:`prepare`);
        :meth:`log_health` then sends its counters to the trackers. ``record``: a folder
        for the flight recorder's replay bundles (``amped.monitor``'s ``record=``)."""
        if self.setup is None:
            raise RuntimeError(
                "monitor() needs a prepared model and optimizer; call prepare first."
            )
        self.health = monitor(
            self.setup, every, on_nonfinite=on_nonfinite, strict=strict, record=record
        )
        return self.health

    def log_health(self, step: int | None = None) -> dict[str, float]:
        """Log the monitor's per-GEMM counters with :meth:`log` (to every tracker given
        as ``log_with``); returns them. One sync."""
        if self.health is None:
            raise RuntimeError("log_health() needs a monitor; call accelerator.monitor() first.")
        metrics = health_metrics(self.health)
        self.log(metrics, step=step)
        return metrics

    def _save_recipe_state(self, models: Any, weights: Any, output_dir: Any) -> None:
        """``save_state``'s pre-hook: refuse inf/NaN weights or optimizer state, then
        write the recipe's state to ``RECIPE_STATE_NAME``, before Accelerate writes."""
        if not self.allow_nonfinite:
            state = {"weights": weights, "optimizers": [o.state_dict() for o in self._optimizers]}
            where = f"the Accelerate state in {str(output_dir)!r}"
            refuse_nonfinite(state, where, root="save_state")
        save_on_each_node = self.project_configuration.save_on_each_node
        if self.is_main_process or (save_on_each_node and self.is_local_main_process):
            save_checkpoint(
                os.path.join(output_dir, RECIPE_STATE_NAME),
                allow_nonfinite=self.allow_nonfinite,
                **self.recipe_state.state_dict(),
            )

    def _read_recipe_state(self, models: Any, input_dir: Any) -> None:
        """``load_state``'s pre-hook: read and check the recipe's state before Accelerate
        loads anything; :meth:`load_state` applies it after Accelerate's own."""
        pickles = sorted(f for f in os.listdir(input_dir) if _CUSTOM_CHECKPOINT.match(f))
        if len(pickles) > len(self._custom_objects):
            # Accelerate would fully unpickle them (code runs) before
            # noticing that they outnumber the registered objects.
            raise CheckpointError(
                f"Refusing to load {str(input_dir)!r}: it holds "
                f"{', '.join(repr(os.path.join(input_dir, f)) for f in pickles)}, "
                f"{len(pickles)} pickled state file(s) for {len(self._custom_objects)} "
                "object(s) registered with register_for_checkpointing, and Accelerate "
                "unpickles them in full (weights_only off), which can run code. An older "
                "amped kept the recipe's state there; this version writes "
                f"{RECIPE_STATE_NAME!r}. Resume from a folder this version saved, or "
                "remove the extra files if you trust them. Nothing was loaded."
            )
        path = os.path.join(input_dir, RECIPE_STATE_NAME)
        if not os.path.isfile(path):
            raise CheckpointError(
                f"No recipe state in {str(input_dir)!r}: amped's Accelerator writes "
                f"{RECIPE_STATE_NAME!r} beside Accelerate's files in save_state, and "
                f"{path!r} is missing. Nothing was loaded."
            )
        self._loaded_recipe_state = load_checkpoint(path, map_location="cpu")

    def load_state(
        self, input_dir: str | None = None, load_kwargs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        """Accelerate's ``load_state``, then the recipe's state from ``RECIPE_STATE_NAME``
        (read and checked before Accelerate loads anything).

        Raises:
            CheckpointError: the recipe's state file is missing, or torn, corrupt or not
                a plain state (a pickle that would run code is refused unexecuted); the
                message names the file. Nothing was loaded.
        """
        self._loaded_recipe_state = None
        super().load_state(input_dir, load_kwargs, **kwargs)
        state, self._loaded_recipe_state = self._loaded_recipe_state, None
        if state is not None:
            self.recipe_state.load_state_dict(state)

    # --- prepare -----------------------------------------------------------------------

    def prepare(self, *args: Any, device_placement: Any = None) -> Any:
        """:func:`amped.prepare` on the model and optimizer among ``args``, then Accelerate's."""
        models = [a for a in args if isinstance(a, torch.nn.Module)]
        optimizers = [
            a
            for a in args
            if isinstance(a, torch.optim.Optimizer) and not isinstance(a, AcceleratedOptimizer)
        ]
        if optimizers and not models and len(self._models) == 1:
            models = list(self._models)  # prepared by an earlier prepare(model) call
        if optimizers:
            if len(models) != 1 or len(optimizers) != 1:
                raise value_error(
                    "amped's Accelerator prepares one model with its optimizer (in one "
                    "prepare() call, or the model first)",
                    "(models, optimizers)",
                    (len(models), len(optimizers)),
                )
            user = optimizers[0]
            setup = self._prepare_recipe(models[0], user)
            args = tuple(setup.optimizer if a is user else a for a in args)
            for a in args:
                rebind_scheduler(a, user, setup.optimizer)
        return super().prepare(*args, device_placement=device_placement)

    def _prepare_recipe(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> TrainSetup:
        if self.setup is not None:
            raise RuntimeError(
                f"This Accelerator already runs recipe {self.recipe.name!r} on a model; "
                "prepare one model and optimizer per Accelerator. "
                + received("type(model)", type(model))
            )
        self.setup = amped.prepare(
            model, optimizer, self.recipe, policy=self.policy, scaler=self.recipe_scaler
        )
        return self.setup

    def prepare_model(self, model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        """Accelerate's ``prepare_model``, with the forward run in the recipe's region."""
        model = super().prepare_model(model, *args, **kwargs)
        if self.recipe.autocast and not hasattr(model, "_original_forward"):
            # As Accelerate wraps it, so that its unwrap_model(keep_fp32_wrapper=False)
            # finds the original function under the __wrapped__ chain.
            original = model.forward
            function = getattr(original, "__func__", None)
            region = self.autocast
            if function is None:

                @functools.wraps(original)
                def forward(*a: Any, **k: Any) -> Any:
                    with region():
                        return original(*a, **k)

                wrapped: Any = convert_outputs_to_fp32(forward)
            else:

                @functools.wraps(function)
                def method(module: Any, *a: Any, **k: Any) -> Any:
                    with region():
                        return function(module, *a, **k)

                wrapped = MethodType(convert_outputs_to_fp32(method), model)
            model.__dict__["_original_forward"] = original  # where Accelerate keeps it
            model.forward = wrapped
        return model

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: Any = None
    ) -> Any:
        """Wrap the recipe's optimizer so that its step runs through the recipe."""
        if self.setup is None or optimizer is not self.setup.optimizer:
            return super().prepare_optimizer(optimizer, device_placement=device_placement)
        if device_placement is None:
            device_placement = self.device_placement
        wrapped = RecipeOptimizer(self.setup, device_placement=device_placement)
        self._optimizers.append(wrapped)
        return wrapped

    # --- the loop ----------------------------------------------------------------------

    @contextlib.contextmanager
    def autocast(self, autocast_handler: Any = None) -> Generator[None, None, None]:
        """The recipe's autocast region, with the policy."""
        if self.setup is not None:
            region: contextlib.AbstractContextManager[Any] = self.setup.autocast()
        elif self.recipe.autocast:
            region = autocast(self.device_type, dtype=self.recipe.dtype, policy=self.policy)
        else:
            region = contextlib.nullcontext()
        with region:
            yield

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss / gradient_accumulation_steps``, scaled when the recipe scales it, backward
        (the loss as given goes to the setup's monitor, as ``setup.backward`` hands it)."""
        if self.setup is not None and self.setup.monitor is not None:
            self.setup.monitor.observe_loss(loss)
        loss = loss / self.gradient_accumulation_steps
        self.recipe_scaler.scale(loss).backward(**kwargs)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Unscale the gradients the optimizer steps (O2: moved into the masters first)."""
        if self.setup is not None:
            self.setup.unscale_()

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        """Unscale, then clip the gradients the optimizer steps: the masters under O2.

        Passing the model's parameters (as usual) clips what the recipe's optimizer
        steps; other parameters are clipped as given. A fused optimizer is fine here, as
        in Accelerate: the gradients are unscaled before clipping, and the scaler then
        tells the fused step not to unscale again.
        """
        if self.setup is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        self.unscale_gradients()
        return torch.nn.utils.clip_grad_norm_(
            self._main_params(parameters), max_norm, norm_type=norm_type
        )

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Unscale, then clip gradient values of what the optimizer steps."""
        if self.setup is None:
            return super().clip_grad_value_(parameters, clip_value)
        self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(self._main_params(parameters), clip_value)
        return None

    def _main_params(self, parameters: Any) -> list[torch.Tensor]:
        assert self.setup is not None
        given = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        model_ids = {id(p) for p in self.setup.model.parameters()}
        if {id(p) for p in given} <= model_ids:
            return self.setup.main_params(given)
        return given

    def memory_report(self) -> MemoryReport:
        """:func:`amped.memory_report` of the model and optimizer the recipe trains."""
        if self.setup is None:
            raise RuntimeError("memory_report() needs a prepared model and optimizer.")
        return memory_report(self.setup.model, self.setup.optimizer)

    def teardown(self) -> None:
        """Undo what the recipe installed; the model gets float32 weights back."""
        if self.setup is not None:
            self.setup.teardown()


class RecipeOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper stepping through the recipe: unscale, skip on
    overflow (``step_was_skipped``), master copy-back."""

    def __init__(self, setup: TrainSetup, device_placement: bool = True) -> None:
        super().__init__(setup.optimizer, device_placement=device_placement, scaler=None)
        self.setup = setup

    def step(self, closure: Any = None) -> None:
        """Step through the recipe when gradients are synchronised (end of accumulation)."""
        if closure is not None:
            raise type_error(
                "amped's recipes step without a closure; call backward before step()",
                "closure",
                closure,
            )
        if self.gradient_state.sync_gradients:
            self._is_overflow = not self.setup.step()


class RecipeState:
    """What the recipe keeps beside the model and optimizer, for ``save_state``: the
    scaler and, under O2, the float32 master weights (the model holds their rounded
    copies). :class:`Accelerator` writes it to ``RECIPE_STATE_NAME`` itself."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, Any]:
        setup = self.accelerator.setup
        return {} if setup is None else setup.recipe_state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        setup = self.accelerator.setup
        if setup is not None and state:
            setup.load_recipe_state_dict(state)
