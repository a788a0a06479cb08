"""The transformers ``Trainer`` with an amped recipe.

Since v5 the ``Trainer`` hands all mixed precision to Accelerate, so this subclass
builds amped's :class:`~amped.integrations.accelerate.Accelerator` in place of
Accelerate's and leaves the rest of the Trainer as it is::

    from amped.integrations.transformers import Trainer
    trainer = Trainer(model=model, args=args, train_dataset=data, recipe="bf16-master")
    trainer.train()

Leave ``TrainingArguments(bf16=..., fp16=...)`` False: the recipe says the dtype.
Clipping (``max_grad_norm``) acts on the unscaled gradients the recipe's optimizer
steps (O2: the float32 masters); the learning-rate scheduler skips with a skipped
optimizer step (the Trainer reads ``optimizer_step_was_skipped``).

Everything ends in float32, as with Lightning: when ``train()`` returns (or raises)
the model has float32 weights again (:meth:`~amped.recipes.TrainSetup.teardown`), and
``save_model()`` and every checkpoint folder write a float32 ``model.safetensors``:
the recipe's best float32 weights (:meth:`~amped.recipes.TrainSetup.fp32_state_dict`:
O2's masters, bf16-pure's weights plus compensation), loadable anywhere with
``from_pretrained``. Checkpoints also hold ``scaler.pt`` (fp16 recipes, as the Trainer
writes it) and ``amped_recipe.pt`` (the recipe's state: the scaler, O2's masters and,
for recipes that lower the weights, the low-precision weights the run stepped), all
restored on ``train(resume_from_checkpoint=...)``, so a resumed run is bitwise the
uninterrupted one. One ``train()`` per Trainer.

Requires ``transformers`` and ``accelerate`` (from amped's clone:
``pip install -e ".[transformers]"``); ``import amped`` never imports them.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import transformers
import transformers.trainer as trainer_module

from amped._internal.errors import value_error
from amped.checkpoint.save_load import load_checkpoint
from amped.integrations.accelerate import Accelerator
from amped.integrations.common import resolve_arguments
from amped.policy import Policy
from amped.recipes import Recipe

__all__ = ["RECIPE_STATE_NAME", "Trainer"]

RECIPE_STATE_NAME = "amped_recipe.pt"
"""The file, in each checkpoint folder, that holds the recipe's state."""

_LOWERED_WEIGHTS = "lowered_model"  # amped_recipe.pt's entry: the weights as trained


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` that trains with an amped recipe.

    Args:
        *args: the Trainer's arguments.
        recipe: a recipe name or alias (see :data:`amped.recipes.registry.RECIPES`).
        policy: the autocast policy, an :class:`amped.Policy` for the training device
            or a preset name.
        **kwargs: the Trainer's keyword arguments.

    Raises:
        ValueError: an unknown recipe, ``TrainingArguments(bf16=True)`` or
            ``fp16=True`` given as well, or a policy for another device.
    """

    accelerator: Accelerator

    def __init__(
        self,
        *args: Any,
        recipe: str | Recipe = "bf16-mixed",
        policy: Policy | str | None = None,
        **kwargs: Any,
    ) -> None:
        self.amped_recipe, _, _ = resolve_arguments(recipe, None, "cpu")
        self.amped_policy = policy
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        for flag in ("bf16", "fp16"):
            if getattr(training_args, flag, False):
                raise value_error(
                    f"amped's Trainer takes recipe= and leaves TrainingArguments({flag}=False); "
                    f"the recipe ({self.amped_recipe.name!r}) says the dtype",
                    flag,
                    getattr(training_args, flag),
                )
        super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's own set-up, with amped's Accelerator in place of Accelerate's."""
        recipe, policy = self.amped_recipe, self.amped_policy

        def build(**kwargs: Any) -> Accelerator:
            return Accelerator(recipe=recipe, policy=policy, **kwargs)

        original = trainer_module.Accelerator
        trainer_module.Accelerator = build
        try:
            super().create_accelerator_and_postprocess()
        finally:
            trainer_module.Accelerator = original

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``transformers.Trainer.train``; the model has float32 weights when it returns."""
        try:
            return super().train(*args, **kwargs)
        finally:
            self.accelerator.teardown()

    def _save(
        self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None
    ) -> None:
        """Write the model in float32: the recipe's float32 weights while it trains."""
        setup = self.accelerator.setup
        if state_dict is None and setup is not None and setup.installed is not None:
            state_dict = setup.fp32_state_dict()
        super()._save(output_dir, state_dict=state_dict)

    def _save_scaler(self, output_dir: str) -> None:
        super()._save_scaler(output_dir)
        if self.args.should_save:
            state = self.accelerator.recipe_state.state_dict()
            setup = self.accelerator.setup
            if setup is not None and setup.installed is not None:
                # model.safetensors holds float32 weights; these are the very ones
                # the run stepped, so that a resumed run is bitwise.
                state[_LOWERED_WEIGHTS] = setup.model.state_dict()
            torch.save(state, os.path.join(output_dir, RECIPE_STATE_NAME))

    def _load_scaler(self, checkpoint: str | None) -> None:
        super()._load_scaler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, RECIPE_STATE_NAME)
        if os.path.isfile(path):
            # Checked whole, then torch.load(weights_only=True): a planted pickle is a
            # CheckpointError naming the file, never run.
            state = load_checkpoint(path, map_location="cpu")
            lowered = state.pop(_LOWERED_WEIGHTS, None)
            self.accelerator.recipe_state.load_state_dict(state)
            setup = self.accelerator.setup
            if lowered is not None and setup is not None:
                setup.model.load_state_dict(lowered)
