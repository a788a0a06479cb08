"""The O2 recipes, ``bf16-master`` and ``fp16-master``: low-precision weights, float32 masters.

The model keeps low-precision weights and gradients, except in the modules the
policy runs in float32 (norm layers by default); the optimizer steps float32 master
copies (:class:`~amped.optim.master.MasterWeightOptimizer`, fused into one kernel a
chunk for Adam, AdamW and SGD). The forward pass runs under autocast with the user's
policy, so ops the policy lists in float32 (losses, softmax on CUDA) still run in
float32, and weights are never re-cast per step: they already have the low dtype. The
norm layers the recipe adds run in float32 by the one float32-module rule, through forward
hooks of their own (:func:`amped.autocast_mode.float32_modules.run_in_float32`), not
through a rule of the region's policy, so the region is torch's C++ autocast wherever
the user's policy is torch's.

Checkpoints hold the masters: ``state_dict()["model"]`` is a float32 state dict with
the model's keys, which loads into a plain float32 model as it is.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch
from torch.utils.hooks import RemovableHandle

from amped._internal.errors import value_error
from amped.autocast_mode.float32_modules import run_in_float32
from amped.optim.master import MasterWeightOptimizer, check_wrappable
from amped.policy import Policy
from amped.recipes.setup import TrainSetup
from amped.recipes.weights import kept_in_fp32, lower_model_, with_norms_in_fp32

__all__ = ["MasterSetup", "build_master_setup"]


class MasterSetup(TrainSetup):
    """A :class:`~amped.recipes.TrainSetup` whose optimizer steps float32 master weights."""

    optimizer: MasterWeightOptimizer
    _norm_hooks: tuple[RemovableHandle, ...] = ()
    _low_gradients: _LowGradients | None = None

    def _prepare_grads(self) -> None:
        if not self.optimizer._takes_low_gradients():
            self.optimizer.grads_to_masters()

    def unscale_(self) -> None:
        """Cast the gradients into the masters' float32 ones and unscale those, once per
        step (for clipping: see :meth:`TrainSetup.unscale_`). No sync."""
        self.optimizer.grads_to_masters()
        self.scaler.unscale_(self.optimizer)

    def step(self) -> bool:
        """As :meth:`TrainSetup.step`. Where the fused step reads the low-precision
        gradients under loss scaling, the scaler checks those (one pass over them) and
        the kernel unscales them. Syncs once when the recipe scales the loss."""
        if not (self.scaler.is_enabled() and self.optimizer._takes_low_gradients()):
            return super().step()
        # One object for the whole run: the scaler keeps its stall counts by its id.
        if self._low_gradients is None or self._low_gradients.optimizer is not self.optimizer:
            self._low_gradients = _LowGradients(self.optimizer)
        self.scaler.step(cast(torch.optim.Optimizer, self._low_gradients))
        self.scaler.update()
        stepped = not self.scaler.last_step_skipped  # decided on the host: no sync
        self._after_step(stepped)
        if self.low_precision_layers is not None:
            self.low_precision_layers.update()
        return stepped

    def teardown(self) -> None:
        """As :meth:`TrainSetup.teardown`; also removes the norm layers' float32 hooks."""
        super().teardown()
        for handle in self._norm_hooks:
            handle.remove()
        self._norm_hooks = ()

    def _after_step(self, stepped: bool) -> None:
        if not stepped:  # a skipped step leaves float32 gradients behind: free them now
            for _, master in self.optimizer.pairs:
                master.grad = None

    def fp32_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict with each lowered weight replaced by its float32 master.

        Tensors are live (as ``Module.state_dict`` gives them); the other floating
        entries (float32 norms, lowered buffers) come as float32.
        """
        masters = {id(param): master for param, master in self.optimizer.pairs}
        out: dict[str, torch.Tensor] = {}
        for key, value in self.model.state_dict(keep_vars=True).items():
            tensor = masters.get(id(value), value).detach()
            out[key] = tensor.to(torch.float32) if tensor.is_floating_point() else tensor
        return out

    def state_dict(self) -> dict[str, Any]:
        """Recipe, model (float32 masters, see :meth:`fp32_state_dict`), optimizer, scaler."""
        state = super().state_dict()
        state["model"] = self.fp32_state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`: masters exactly, model weights rounded from them."""
        self.check_state(state)
        model_state = state["model"]
        self.model.load_state_dict(model_state)  # rounds into the low-precision weights
        masters = {id(param): master for param, master in self.optimizer.pairs}
        with torch.no_grad():
            for key, value in self.model.state_dict(keep_vars=True).items():
                master = masters.get(id(value))
                if master is not None:
                    master.copy_(model_state[key])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])

    def main_params(self, params: Iterable[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The float32 masters (and float32 parameters), in the optimizer's order or in
        the order of the model parameters ``params``."""
        if params is None:
            return super().main_params()
        masters = {id(param): master for param, master in self.optimizer.pairs}
        return [masters.get(id(p), p) for p in params]

    def recipe_state_dict(self) -> dict[str, Any]:
        """The recipe's name, the scaler and the float32 masters (in ``pairs`` order),
        which a framework saving only the model's low-precision weights would lose."""
        state = super().recipe_state_dict()
        state["masters"] = [master.detach().clone() for _, master in self.optimizer.pairs]
        return state

    def load_recipe_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`recipe_state_dict`; masters bitwise when present."""
        super().load_recipe_state_dict(state)
        masters = state.get("masters")
        if masters is None:
            return
        pairs = self.optimizer.pairs
        if len(masters) != len(pairs):
            raise value_error(
                f"This recipe state holds {len(masters)} master weights, the setup has "
                f"{len(pairs)}: it was saved from another model",
                "len(state['masters'])",
                len(masters),
            )
        with torch.no_grad():
            for (param, master), saved in zip(pairs, masters, strict=True):
                master.copy_(saved)
                param.copy_(master)

    def model_state_dict(self) -> dict[str, Any]:
        """The float32 masters under the model's keys (:meth:`fp32_state_dict`)."""
        return self.fp32_state_dict()

    def _restore_weights(self) -> None:
        # Each master becomes its parameter's data again (the very float32 storage the
        # parameter had, or a copy where the fused step laid the masters out in one
        # tensor), and the parameter goes back under the user's optimizer in the
        # master's place, with the master's optimizer state.
        inner = self.optimizer.optimizer
        back = {id(master): param for param, master in self.optimizer.pairs}
        for group in inner.param_groups:
            params = group["params"]
            for i, master in enumerate(params):
                param = back.get(id(master))
                if param is None:
                    continue
                params[i] = param
                if master in inner.state:
                    inner.state[param] = inner.state.pop(master)
        with torch.no_grad():
            for param, master in self.optimizer.pairs:
                data = master.detach()
                if data.untyped_storage().nbytes() != data.numel() * data.element_size():
                    data = data.clone()  # a view of the fused step's masters: its own memory
                param.data = data
                param.grad = None
        self.optimizer._pairs.clear()


class _LowGradients:
    """What the scaler checks and steps when the fused step reads low-precision
    gradients: those gradients (with the float32 parameters'), in an optimizer that, as
    torch's fused ones, unscales inside its own step (``_step_supports_amp_scaling``: the
    scaler then checks the gradients without unscaling them and hands over
    ``grad_scale``). The scaler decides on the host whether to step
    (``_amped_decides_on_host``: one sync, which also reports a stall in every
    ``on_stall`` mode), and calls :meth:`step` only on a clean iteration."""

    _step_supports_amp_scaling = True
    _amped_decides_on_host = True

    def __init__(self, optimizer: MasterWeightOptimizer) -> None:
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """One group of the gradients the fused step reads: each master's low-precision
        parameter, and the float32 parameters as they are."""
        lows = {id(master): param for param, master in self.optimizer.pairs}
        groups = self.optimizer.param_groups
        return [{"params": [lows.get(id(p), p) for g in groups for p in g["params"]]}]

    def step(self) -> None:
        self.optimizer._step_unscaling(self.grad_scale)  # type: ignore[attr-defined]


def float32_norms(plain: TrainSetup) -> tuple[Policy, list[torch.nn.Module]]:
    """The policy that decides which weights stay float32 (the user's, torch's by default,
    with the model's norm layers added first), and the modules kept in float32 by the
    added rules alone, outermost only: those the recipe hooks to run in float32."""
    user = plain.policy or Policy.preset("torch", plain.device_type)
    policy = with_norms_in_fp32(user, plain.model)
    added = kept_in_fp32(plain.model, policy) - kept_in_fp32(plain.model, user)
    modules = [
        module
        for name, module in plain.model.named_modules()
        if name in added and name.rpartition(".")[0] not in added
    ]
    return policy, modules


def build_master_setup(plain: TrainSetup) -> MasterSetup:
    """Lower ``plain.model`` in place and put float32 masters under ``plain.optimizer``."""
    check_wrappable(plain.optimizer)  # before the model is touched
    dtype = plain.recipe.dtype
    assert dtype is not None  # Recipe.__post_init__ guarantees it
    policy, norms = float32_norms(plain)
    originals = lower_model_(plain.model, dtype, policy)
    wrapped = MasterWeightOptimizer(plain.optimizer, originals)
    setup = MasterSetup(
        plain.recipe, plain.model, wrapped, plain.scaler, plain.device_type, plain.policy
    )
    setup._norm_hooks = tuple(run_in_float32(norms, plain.device_type))
    return setup
