"""What the framework adapters share: argument checks, clipping rules, a scheduler that
skips with the optimizer. Imports no framework."""

from __future__ import annotations

from typing import Any

import torch

from amped._internal.errors import received, type_error, value_error
from amped._internal.torch_compat import steps_with_amp_scaling, track_step_for_scheduler
from amped.policy import Policy
from amped.recipes import Recipe, TrainSetup
from amped.recipes.registry import resolve_recipe
from amped.scaling import GradScaler

__all__ = ["SkipAwareScheduler", "check_clipping", "rebind_scheduler", "resolve_arguments"]


def resolve_arguments(
    recipe: str | Recipe, policy: Policy | str | None, device: str | None
) -> tuple[Recipe, Policy | None, str]:
    """Check a plugin's arguments at construction: the recipe exists, and the policy is
    for the device the plugin runs on. Returns ``(recipe, policy, device_type)``."""
    chosen = resolve_recipe(recipe)
    if device is not None and not isinstance(device, str):
        raise type_error("device is a device type such as 'cpu' or 'cuda'", "device", device)
    if isinstance(policy, Policy):
        if device is not None and policy.device_type != device:
            raise value_error(
                f"The policy is for device {policy.device_type!r} but the plugin runs on "
                f"{device!r}; pass a policy built for {device!r} (amped.Policy.preset(name, "
                f"{device!r}))",
                "policy.device_type",
                policy.device_type,
            )
        device = device or policy.device_type
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise value_error(
            "The plugin would run on 'cuda' (its device, or its policy's), but CUDA is not "
            "available here; pass device='cpu' and a policy built for 'cpu'",
            "device",
            device,
        )
    if isinstance(policy, str):
        policy = Policy.preset(policy, device)
    elif policy is not None and not isinstance(policy, Policy):
        raise type_error(
            "policy is an amped.Policy or a preset name such as 'torch'", "policy", policy
        )
    return chosen, policy, device


def default_scaler(recipe: Recipe, device: str, scaler: GradScaler | None) -> GradScaler:
    """The scaler a plugin uses: the user's, or one enabled exactly for loss-scaling recipes."""
    if scaler is None:
        return GradScaler(device, enabled=recipe.loss_scaling)
    if not isinstance(scaler, GradScaler):
        raise type_error(
            "scaler is an amped.GradScaler (amped drives its strategy and state)", "scaler", scaler
        )
    return scaler


def optimizer_unscales_itself(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` (or the one it wraps) unscales inside ``step()`` (fused)."""
    return steps_with_amp_scaling(getattr(optimizer, "optimizer", optimizer))


def check_clipping(setup: TrainSetup, clip_val: float) -> None:
    """Refuse clipping when the optimizer unscales inside its step: the gradients
    clipping would see are still multiplied by the loss scale (Lightning refuses it too)."""
    if clip_val > 0 and setup.scaler.is_enabled() and optimizer_unscales_itself(setup.optimizer):
        name = type(getattr(setup.optimizer, "optimizer", setup.optimizer)).__name__
        raise RuntimeError(
            f"Gradient clipping cannot run with {name}(fused=True) under loss scaling: a "
            "fused optimizer unscales inside step(), so clipping before it sees scaled "
            "gradients. Build the optimizer with fused=False, or turn clipping off. "
            + received("clip_val", clip_val)
        )


def rebind_scheduler(
    scheduler: Any, old: torch.optim.Optimizer, new: torch.optim.Optimizer
) -> None:
    """Point a learning-rate scheduler built on ``old`` at ``new`` (bf16-pure's twin).

    Anything else (an optimizer, a scheduler on another optimizer, O2's wrapper of
    ``old``, whose parameter groups are ``old``'s) is left alone.

    The scheduler's per-group ``initial_lr`` moves over, and ``new.step`` is wrapped
    the way torch's schedulers wrap it, so the scheduler sees whether it stepped.
    """
    if (
        isinstance(scheduler, torch.optim.Optimizer)
        or getattr(scheduler, "optimizer", None) is not old
    ):
        return
    if getattr(new, "optimizer", None) is old:  # O2's wrapper shares old's param groups
        return
    for old_group, new_group in zip(old.param_groups, new.param_groups, strict=True):
        for key in ("initial_lr", "lr"):
            if key in old_group:
                new_group[key] = old_group[key]
    scheduler.optimizer = new
    track_step_for_scheduler(new, replaces=old)


class SkipAwareScheduler:
    """A learning-rate scheduler that does not advance when the optimizer step was skipped.

    A loss-scaling recipe skips the optimizer step when the gradients overflowed; a
    scheduler stepped anyway runs ahead of the optimizer (and torch warns, pytorch
    44511). Every other attribute is the wrapped scheduler's.
    """

    def __init__(self, scheduler: Any, setup: TrainSetup) -> None:
        self.scheduler = scheduler
        self.setup = setup
        self.skipped = 0

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Step the scheduler, unless the last optimizer step was skipped."""
        if self.setup.scaler.is_enabled() and self.setup.scaler.last_step_skipped:
            self.skipped += 1
            return
        self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["scheduler"], name)
