"""Lightning and Fabric precision plugins that run an amped recipe.

Lightning's ``Trainer``::

    from amped.integrations.lightning import CheckpointIO, Precision
    trainer = L.Trainer(plugins=[Precision("bf16-master"), CheckpointIO()])  # no precision=

Fabric (a recipe that changes the model or optimizer needs them first)::

    precision = FabricPrecision("bf16-pure")
    fabric = L.Fabric(plugins=[precision, CheckpointIO()])
    model, optimizer = fabric.setup(*precision.prepare(model, optimizer))

The plugin builds the :class:`~amped.recipes.TrainSetup` of :func:`amped.prepare` and
drives it: the forward context (amped's autocast with the policy), the scaled
backward, unscale (O2: into the float32 masters) before clipping, the step (skipped on
overflow, masters copied back), the parameters clipping sees (the masters under O2),
the recipe's state in checkpoints, and teardown at the end of ``fit``, which gives the
model float32 weights back (:meth:`~amped.recipes.TrainSetup.teardown`). With a
loss-scaling recipe, learning-rate schedulers skip with the optimizer.

Checkpoints are read without running code: Lightning and Fabric load a local one with
``torch.load(weights_only=True)``. Add :class:`CheckpointIO` to ``plugins=`` so that a
file refused (a planted object, a torn write) raises amped's ``CheckpointError`` naming
the file, rather than torch's ``UnpicklingError``, which does not.

Requires ``lightning`` (from amped's clone: ``pip install -e ".[lightning]"``);
``import amped`` never imports it.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Callable, Generator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import Precision as _FabricBase
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.plugins.precision.fsdp import FSDPPrecision as _FabricFSDP
from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT_STR
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import FSDPPrecision as _LightningFSDP
from lightning.pytorch.plugins.precision import Precision as _LightningBase

from amped._internal.errors import received, value_error
from amped.checkpoint.save_load import load_checkpoint, refuse_nonfinite, refused_object_error
from amped.integrations.common import (
    SkipAwareScheduler,
    check_clipping,
    optimizer_unscales_itself,
    rebind_scheduler,
)
from amped.integrations.driver import RecipeDriver, to_dtype
from amped.policy import Policy
from amped.recipes import Recipe, TrainSetup
from amped.recipes.memory import MemoryReport
from amped.recipes.o2 import MasterSetup
from amped.scaling import GradScaler

__all__ = ["CheckpointIO", "FSDPPrecision", "FabricFSDPPrecision", "FabricPrecision", "Precision"]


def _lightning_name(recipe: Recipe) -> _PRECISION_INPUT_STR:
    """The precision string Lightning reports (``trainer.precision``) for a recipe."""
    if recipe.dtype is torch.float16:
        return "16-mixed"
    if recipe.dtype is torch.bfloat16:
        return "bf16-mixed"
    return "32-true"


class _Plugin(RecipeDriver):
    """What the four plugins share: arguments, the parameters clipping sees, the recipe's
    state and teardown. The FSDP ones (``_fsdp``) take the autocast recipes only."""

    _fsdp = False

    def __init__(
        self,
        recipe: str | Recipe = "bf16-mixed",
        *,
        policy: Policy | str | None = None,
        device: str | None = None,
        scaler: GradScaler | None = None,
        allow_nonfinite: bool = False,
    ) -> None:
        self._init_recipe(recipe, policy, device, scaler)
        # Lightning checkpoints with an inf/NaN weight or optimizer state are refused.
        self.allow_nonfinite = allow_nonfinite
        # Lightning's own code reads `precision` (model summary sizes, FSDP dtypes, the
        # throughput monitor), so it stays one of Lightning's strings; the recipe's own
        # name is `recipe.name`, in repr() and in the line logged when training starts.
        self.precision = _lightning_name(self.recipe)
        self._training_report: MemoryReport | None = None
        if self._fsdp:
            _check_fsdp_recipe(self.recipe)
            self._desired_input_dtype = torch.float32  # FSDP's init contexts: float32 weights

    def _observe_loss(self, loss: torch.Tensor) -> None:
        """Hand the loss to the setup's monitor, as ``setup.backward`` does (its
        flight recorder's loss-spike rule reads it)."""
        if self.setup is not None and self.setup.monitor is not None:
            self.setup.monitor.observe_loss(loss)

    def main_params(self, optimizer: Any) -> Any:
        """The parameters clipping must see: the float32 masters under O2."""
        if self.setup is not None and optimizer is self.setup.optimizer:
            return self.setup.main_params()
        return super().main_params(optimizer)  # type: ignore[misc]  # the framework's

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (Lightning: on resume, after the setup is built)."""
        self._load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.recipe.name!r}, device={self.device!r})"

    def _announce(self) -> None:
        rank_zero_info(
            f"amped: training with recipe {self.recipe.name!r} ({self.recipe.summary}); "
            f"Lightning's precision string for it: {self.precision!r}"
        )

    def memory_report(self) -> MemoryReport:
        """:func:`amped.memory_report` of the model and optimizer the recipe trains.

        After :meth:`teardown` (Lightning calls it when ``fit`` ends) this is the last
        training state, measured just before the model got float32 weights back: what
        the recipe held, not the float32 model it leaves.
        """
        if self._training_report is not None:
            return self._training_report
        return super().memory_report()

    def teardown(self) -> None:
        """Undo what the recipe installed (Lightning calls it when fit ends); the model
        gets float32 weights back. :meth:`memory_report` keeps the training state."""
        if self.setup is not None and self._training_report is None:
            self._training_report = super().memory_report()
        self._teardown()

    def _prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainSetup:
        setup = super()._prepare(model, optimizer)
        self._training_report = None  # a new run: its own state from now on
        self._announce()
        return setup


class Precision(_Plugin, _LightningBase):
    """A Lightning precision plugin that trains with an amped recipe.

    Pass it in ``plugins=`` and leave ``precision=`` unset (Lightning refuses both).

    Args:
        recipe: a recipe name or alias (``"bf16-mixed"``, ``"fp16-mixed"``,
            ``"bf16-master"``, ``"bf16-pure"``, ...; see :data:`amped.recipes.registry.RECIPES`).
        policy: the autocast policy, an :class:`amped.Policy` for ``device`` or a
            preset name.
        device: the device type the model trains on (default: the policy's, else
            ``"cuda"`` when available, else ``"cpu"``).
        scaler: an :class:`amped.GradScaler` to use instead of the recipe's default.

    Raises:
        ValueError: an unknown recipe, or a policy built for another device.

    The weight-changing recipes need one optimizer from ``configure_optimizers`` and
    a single-device strategy; a bf16-pure run's optimizer is the compensated twin, to
    which learning-rate schedulers are re-pointed. The model returns to float32 when
    ``fit`` ends.
    """

    def connect(
        self, model: torch.nn.Module, optimizers: list[Any], lr_schedulers: list[Any]
    ) -> tuple[torch.nn.Module, list[Any], list[Any]]:
        """Prepare the model and its optimizer for the recipe (Lightning calls it in setup)."""
        if not optimizers:  # validate / test / predict: the forward context alone
            return model, optimizers, lr_schedulers
        if len(optimizers) != 1:
            raise value_error(
                "amped's Lightning plugin trains one optimizer; configure_optimizers "
                "returned several. Use one optimizer over all parameters (parameter "
                "groups for different settings)",
                "len(optimizers)",
                len(optimizers),
            )
        if self.recipe.weights != "fp32" and not isinstance(model, pl.LightningModule):
            raise value_error(
                f"Recipe {self.recipe.name!r} lowers the model's weights, which a strategy "
                "that wraps the model (DDP, FSDP, DeepSpeed) has already bucketed or "
                "sharded. Use a single-device strategy, or an autocast recipe "
                "('bf16-mixed', 'fp16-mixed')",
                "type(model)",
                type(model),
            )
        user = optimizers[0]
        setup = self._prepare(model, user)
        for config in lr_schedulers:
            rebind_scheduler(config.scheduler, user, setup.optimizer)
            if setup.scaler.is_enabled() and config.interval == "step":
                config.scheduler = SkipAwareScheduler(config.scheduler, setup)
        return setup.model, [setup.optimizer], lr_schedulers

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """The recipe's autocast region, with the policy."""
        with self._forward_context():
            yield

    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        """Scale the loss when the recipe scales it."""
        self._observe_loss(tensor)
        return super().pre_backward(self.scaler.scale(tensor), module)

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        """Run the closure, unscale (O2: into the masters), clip, then step or skip."""
        setup = self._require_setup(optimizer)
        closure_result = closure()
        # Lightning skips the step when training_step returned None (automatic optimization).
        skip = closure_result is None and model.automatic_optimization
        if not skip and not (setup.scaler.is_enabled() and optimizer_unscales_itself(optimizer)):
            setup.unscale_()
        self._after_closure(model, optimizer)
        if not skip:
            setup.step()
        return closure_result

    def clip_gradients(
        self, optimizer: Any, clip_val: int | float = 0.0, gradient_clip_algorithm: Any = None
    ) -> None:
        """Clip the gradients the optimizer steps (unscaled; the masters under O2)."""
        if self.setup is not None:
            check_clipping(self.setup, float(clip_val))
        if gradient_clip_algorithm is None:
            super().clip_gradients(optimizer, clip_val)
        else:
            super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Save the model at the recipe's full precision: O2's float32 masters as the weights.

        Raises:
            CheckpointError: a weight or optimizer state holds an inf or NaN (named);
                ``Precision(..., allow_nonfinite=True)`` saves it anyway.
        """
        if isinstance(self.setup, MasterSetup) and "state_dict" in checkpoint:
            checkpoint["state_dict"] = self.setup.model_state_dict()
        if not self.allow_nonfinite:
            keys = ("state_dict", "optimizer_states")
            saved = {key: checkpoint[key] for key in keys if key in checkpoint}
            refuse_nonfinite(saved, "the Lightning checkpoint", root="checkpoint")

    def state_dict(self) -> dict[str, Any]:
        """The recipe's name and its scaler's state (saved in Lightning checkpoints; O2's
        masters are the checkpoint's model weights, see :meth:`on_save_checkpoint`)."""
        state = self._state_dict()
        state.pop("masters", None)
        return state


class FSDPPrecision(Precision, _LightningFSDP):  # type: ignore[misc]  # scaler: amped's, not ShardedGradScaler
    """:class:`Precision` for Lightning's ``FSDPStrategy``, which takes only plugins of
    its ``FSDPPrecision`` type: ``FSDPStrategy(precision_plugin=FSDPPrecision("bf16-mixed"))``.

    The autocast recipes only: FSDP keeps the float32 parameters as flat shards and
    casts them itself (``mixed_precision_config``, as Lightning's own plugin sets it),
    so the weight-changing recipes have nothing to lower. Under a loss-scaling recipe
    the scaler agrees on skipping across all ranks (the default process group).
    Clipping by norm is refused, as Lightning refuses it under FSDP.

    Raises:
        ValueError: a weight-changing recipe, an unknown recipe, or a policy for
            another device.
    """

    _fsdp = True

    def connect(
        self, model: torch.nn.Module, optimizers: list[Any], lr_schedulers: list[Any]
    ) -> tuple[torch.nn.Module, list[Any], list[Any]]:
        """As :meth:`Precision.connect`; the scaler agrees across ranks on overflows."""
        _agree_across_ranks(self.scaler)
        return super().connect(model, optimizers, lr_schedulers)


class FabricPrecision(_Plugin, _FabricBase):
    """A Fabric precision plugin that trains with an amped recipe.

    Arguments as :class:`Precision`. Recipes that change the model or optimizer
    (``*-master``, ``bf16-pure*``) need both at once, which Fabric's plugins never
    get: pass ``precision.prepare(model, optimizer)``'s results to ``fabric.setup``.
    Put the plugin in ``fabric.save``'s state to checkpoint what the recipe keeps (the
    scaler; O2's float32 masters, which the model's state dict has only rounded).
    Outputs come back in float32, as Fabric's own mixed precision returns them.
    """

    def prepare(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """Prepare ``model`` and ``optimizer`` for the recipe; pass the results to fabric.setup."""
        setup = self._prepare(model, optimizer)
        return setup.model, setup.optimizer

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Check the module was prepared when the recipe changes weights."""
        if self.recipe.weights != "fp32" and (self.setup is None or module is not self.setup.model):
            raise RuntimeError(
                f"Recipe {self.recipe.name!r} changes the model and the optimizer together; "
                "call model, optimizer = precision.prepare(model, optimizer) before "
                "fabric.setup(model, optimizer). " + received("type(module)", type(module))
            )
        return module

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        """The recipe's autocast region, with the policy."""
        return self._forward_context()

    def convert_input(self, data: Any) -> Any:
        """Floating inputs to the recipe's low dtype, as Fabric's mixed precision does."""
        if not self.recipe.autocast or self.recipe.dtype is None:
            return data
        return to_dtype(data, self.recipe.dtype)

    def convert_output(self, data: Any) -> Any:
        """Floating outputs to float32, as Fabric's mixed precision does."""
        if not self.recipe.autocast:
            return data
        return to_dtype(data, torch.float32)

    def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        """Backward from the loss, scaled when the recipe scales it (Fabric ignores what
        ``pre_backward`` returns, so the scaling happens here)."""
        self._observe_loss(tensor)
        self.scaler.scale(tensor).backward(*args, **kwargs)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Step (or skip on overflow) and update the scale."""
        setup = self._setup_for(optimizer)
        return setup.step()

    def unscale_gradients(self, optimizer: Any) -> None:
        """Unscale (O2: into the masters) before clipping; refuses fused optimizers."""
        setup = self._setup_for(optimizer)
        check_clipping(setup, 1.0)
        setup.unscale_()

    def _setup_for(self, optimizer: Any) -> TrainSetup:
        """The setup stepping ``optimizer``; for the autocast recipes, built on first use."""
        if self.setup is None and self.recipe.weights == "fp32":
            params = [p for g in optimizer.param_groups for p in g["params"]]
            holder = torch.nn.Module()
            holder.params = torch.nn.ParameterList(params)
            self._prepare(holder, optimizer)
        return self._require_setup(optimizer)

    def state_dict(self) -> dict[str, Any]:
        """The recipe's name, its scaler's state and O2's float32 masters."""
        return self._state_dict()


class FabricFSDPPrecision(FabricPrecision, _FabricFSDP):  # type: ignore[misc]  # amped's scaler
    """:class:`FabricPrecision` for Fabric's ``FSDPStrategy``, which takes only plugins of
    its ``FSDPPrecision`` type. The autocast recipes only, as :class:`FSDPPrecision`;
    inputs stay float32, as Fabric's own FSDP mixed precision keeps them.

    Raises:
        ValueError: a weight-changing recipe, an unknown recipe, or a policy for
            another device.
    """

    _fsdp = True

    def convert_input(self, data: Any) -> Any:
        """Floating inputs to float32, as Fabric's FSDP mixed precision does."""
        return to_dtype(data, torch.float32)

    def _setup_for(self, optimizer: Any) -> TrainSetup:
        _agree_across_ranks(self.scaler)
        return super()._setup_for(optimizer)


class CheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO``, reading files with amped's checks; for the
    Trainer and Fabric alike: ``plugins=[Precision("bf16-master"), CheckpointIO()]``.

    Lightning gives a precision plugin no hook before it reads a checkpoint, so this
    is a plugin of its own. Writing is Lightning's. A local path is read with
    :func:`amped.checkpoint.load_checkpoint`: the archive checked whole (layout, every
    CRC-32), then ``torch.load(weights_only=True)``. A URL (fsspec: ``s3://``,
    ``https://``, ``file://``) is read by Lightning with ``weights_only=True``,
    where Lightning's own reader unpickles an ``http(s)`` one in full. A caller who
    turns ``weights_only`` off in ``fit``/``load`` trusts the whole file: Lightning's
    reader, unchanged, with the caller's setting.

    Raises:
        CheckpointError: the file holds an object ``weights_only=True`` refuses (a
            planted pickle; it never runs), or is torn, truncated or corrupt. The
            message names the file; nothing was loaded.
        FileNotFoundError: no file at the path.
    """

    def load_checkpoint(
        self,
        path: _PATH,
        map_location: Callable[..., Any] | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Read the checkpoint at ``path`` (see the class); ``map_location`` as torch.load's."""
        if weights_only is False:  # the caller's own choice: it trusts the whole file
            return super().load_checkpoint(path, map_location, weights_only=weights_only)
        if "://" not in str(path):  # a local path, not a URL for fsspec
            return load_checkpoint(path, map_location=map_location)
        try:
            return super().load_checkpoint(path, map_location, weights_only=True)
        except pickle.UnpicklingError as error:
            raise refused_object_error(str(path), error) from error


def _check_fsdp_recipe(recipe: Recipe) -> None:
    if recipe.weights != "fp32":
        raise value_error(
            "Under FSDP use an autocast recipe ('bf16-mixed', 'fp16-mixed', 'fp32'): FSDP keeps "
            "float32 flat shards as the masters and casts them itself, so recipe "
            f"{recipe.name!r} has no weights to lower",
            "recipe",
            recipe.name,
        )


def _agree_across_ranks(scaler: GradScaler) -> None:
    """FSDP's sharded gradients are not DTensors: name the group the scaler agrees over."""
    import torch.distributed as dist

    if scaler.is_enabled() and scaler._process_group is None and dist.is_initialized():
        scaler._process_group = dist.group.WORLD
