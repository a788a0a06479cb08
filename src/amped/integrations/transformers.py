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
optimizer step (the Trainer reads ``optimizer_step_was_skipped``). Checkpoints hold
``scaler.pt`` (fp16 recipes, as the Trainer writes it) and ``amped_recipe.pt`` (the
recipe's state: O2's float32 masters, the scaler), both restored on
``train(resume_from_checkpoint=...)``, bitwise.

Requires ``transformers`` and ``accelerate`` (``pip install amped[transformers]``);
``import amped`` never imports them.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import transformers
import transformers.trainer as trainer_module

from amped._internal.errors import value_error
from amped.integrations.accelerate import Accelerator
from amped.integrations.common import resolve_arguments
from amped.policy import Policy
from amped.recipes import Recipe

__all__ = ["RECIPE_STATE_NAME", "Trainer"]

RECIPE_STATE_NAME = "amped_recipe.pt"
"""The file, in each checkpoint folder, that holds the recipe's state."""


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

    def _save_scaler(self, output_dir: str) -> None:
        super()._save_scaler(output_dir)
        if self.args.should_save:
            state = self.accelerator.recipe_state.state_dict()
            torch.save(state, os.path.join(output_dir, RECIPE_STATE_NAME))

    def _load_scaler(self, checkpoint: str | None) -> None:
        super()._load_scaler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, RECIPE_STATE_NAME)
        if os.path.isfile(path):
            self.accelerator.recipe_state.load_state_dict(torch.load(path, weights_only=True))
