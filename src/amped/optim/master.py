"""Float32 master weights for any ``torch.optim`` optimizer (Apex "O2").

The model holds low-precision weights (what the forward and backward pass use); the
optimizer steps float32 master copies of them. Per step::

    master.grad = float32(param.grad)    # grads_to_masters(); frees param.grad
    scaler.unscale_(optimizer)           # on the float32 master gradients
    inner.step()                         # on the masters, at full precision
    param.copy_(master)                  # masters_to_model(): round to nearest, once
    master.grad = None                   # the float32 gradients live only in the step

Small updates accumulate in the float32 masters even when one update is below half an
ulp of the low-precision weight, which is what plain low-precision training loses.

Under ``torch.optim.Adam``, ``AdamW`` and ``SGD`` the five steps run fused by default:
one compiled kernel per chunk of parameters reads the low-precision gradient, unscales
it, steps the master and its state and writes the model's weight
(:mod:`amped.optim.master_step`, which says what it covers and how its numerics
compare). Other optimizers keep the steps above, with one warning saying why.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from amped._internal.errors import type_error, value_error
from amped._internal.torch_compat import amp_unscale_and_check_, init_optimizer_hooks
from amped.optim import state_layout
from amped.optim.master_step import FusedMasterStep, lay_out_data, unsupported, warn_unfused

__all__ = ["MasterWeightOptimizer", "check_wrappable"]

# Optimizers whose step() re-evaluates the model through a closure: the closure's
# backward fills the low-precision gradients, which the masters never see mid-step.
_NEEDS_CLOSURE = ("LBFGS",)
# Optimizers that shard or re-own their parameters; swapping in masters breaks them.
_OWN_PARAMS = ("ZeroRedundancyOptimizer", "_NamedOptimizer", "PostLocalSGDOptimizer")


def check_wrappable(optimizer: object) -> torch.optim.Optimizer:
    """``optimizer`` if master weights can be put under it; a clear error otherwise."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise type_error("Master weights wrap a torch.optim.Optimizer", "optimizer", optimizer)
    name = type(optimizer).__name__
    why = None
    if name in _NEEDS_CLOSURE:
        why = (
            f"{name} cannot step float32 master weights: its step() re-evaluates the model "
            "through a closure, whose backward pass writes low-precision gradients the "
            "masters never receive. Use a first-order optimizer (SGD, Adam, AdamW, ...), "
            "or recipe='fp32'"
        )
    elif name in _OWN_PARAMS:
        why = (
            f"{name} shards or re-owns its parameters, so master copies cannot be swapped "
            "in under it. Wrap the local optimizer it builds instead"
        )
    elif isinstance(optimizer, MasterWeightOptimizer):
        why = "This optimizer already steps master weights; wrap the plain optimizer once"
    if why is not None:
        raise type_error(why, "type(optimizer)", type(optimizer))
    return optimizer


class MasterWeightOptimizer(torch.optim.Optimizer):
    """Steps an optimizer on float32 master copies of its low-precision parameters.

    Works with any ``torch.optim`` optimizer that steps on ``param.grad`` (not LBFGS):
    the inner optimizer's parameter groups are rewired in place to hold the masters,
    so its algorithm, hyper-parameters, state layout and learning-rate schedulers are
    unchanged. Float32 parameters (norms that stay in float32) are stepped as they are.
    ``param_groups``, ``state`` and ``defaults`` are the inner optimizer's.

    Args:
        optimizer: the optimizer over the model's parameters.
        masters: the float32 value each low-precision parameter starts from
            (``prepare`` passes the original weights). A low-precision parameter with no
            entry starts from a float32 copy of its current value.
        fused: ``None`` (default): the fused step where the optimizer and the step allow
            it (:mod:`amped.optim.master_step`), else the unfused one, with one warning
            if the optimizer is why; ``True``: an error instead; ``False``: always the
            unfused step. For the fused step, the masters become views of one tensor
            per device (their ``.data``; each keeps its identity).

    Example:
        >>> import torch, amped
        >>> model = torch.nn.Linear(4, 2).bfloat16()
        >>> opt = amped.optim.MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        >>> model(torch.randn(3, 4, dtype=torch.bfloat16)).float().sum().backward()
        >>> opt.step()
        >>> opt.param_groups[0]["params"][0].dtype, model.weight.dtype
        (torch.float32, torch.bfloat16)
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        masters: Mapping[torch.Tensor, torch.Tensor] | None = None,
        *,
        fused: bool | None = None,
    ) -> None:
        if fused is not None and not isinstance(fused, bool):
            raise type_error("fused must be True, False or None (automatic)", "fused", fused)
        self.optimizer = check_wrappable(optimizer)
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        masters = masters or {}
        for group in optimizer.param_groups:
            params = group["params"]
            for i, param in enumerate(params):
                if param.dtype not in (torch.float16, torch.bfloat16):
                    continue
                master = _master_for(param, masters.get(param))
                params[i] = master  # in place: optimizers that alias the list see it too
                if param in optimizer.state:  # state built before wrapping moves over
                    optimizer.state[master] = optimizer.state.pop(param)
                self._pairs.append((param, master))
        self.fused = fused
        self._fused = self._fused_step(fused)
        if self._fused is not None:
            self._lay_out(self._pairs)
        init_optimizer_hooks(self)  # not Optimizer.__init__: the groups are the inner's

    def _fused_step(self, fused: bool | None) -> FusedMasterStep | None:
        """The fused step, or None with one warning (an error with ``fused=True``)."""
        if fused is False:
            return None
        reason = unsupported(self.optimizer)
        if reason is None:
            return FusedMasterStep(self.optimizer, strict=bool(fused))
        if fused:
            raise type_error(
                f"fused=True cannot step this optimizer: {reason}. Pass fused=None to "
                "fall back to the unfused step, or fused=False",
                "type(optimizer)",
                type(self.optimizer),
            )
        warn_unfused(reason)
        return None

    def _lay_out(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Masters and their existing state as views of one tensor per kind. (Not the
        model's weights: safetensors refuses to save views of a larger storage.)"""
        assert self._fused is not None
        masters = [master for _, master in pairs]
        lay_out_data(masters)
        state_layout.lay_out(self.optimizer.state, masters, self._fused.keys)

    # --- the inner optimizer's data, shared ------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    @property
    def pairs(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """``(low-precision model parameter, float32 master)`` for every lowered parameter."""
        return tuple(self._pairs)

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        """The tensor the optimizer steps for ``param``: its master, or itself if float32."""
        for model_param, master in self._pairs:
            if model_param is param:
                return master
        return param

    # --- the step --------------------------------------------------------------------

    @torch.no_grad()
    def grads_to_masters(self) -> None:
        """Add each low-precision gradient, in float32, to its master's, and free it.

        Call before ``scaler.unscale_``/``scaler.step`` (``TrainSetup.step`` does);
        :meth:`step` calls it too. Adding (not assigning) keeps gradient accumulation
        right if it runs between two backward passes. No sync.
        """
        for param, master in self._pairs:
            grad = param.grad
            if grad is None:
                continue
            if master.grad is None:
                master.grad = grad.to(torch.float32)
            else:
                master.grad.add_(grad)
            param.grad = None

    @torch.no_grad()
    def masters_to_model(self) -> None:
        """Round each master to its parameter's dtype, into the parameter."""
        for param, master in self._pairs:
            param.copy_(master)

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Move gradients to the masters, step the inner optimizer, copy the masters back
        (fused into one pass where it can be: see the module's docstring).

        The float32 master gradients are freed after the step, so they exist only
        between :meth:`grads_to_masters` and the end of the step; the fused step makes
        none, and frees the low-precision gradients it read.
        """
        if closure is not None:
            raise type_error(
                "MasterWeightOptimizer.step() takes no closure: a closure's backward "
                "writes low-precision gradients mid-step. Call backward before step()",
                "closure",
                closure,
            )
        self._step(None)

    def _takes_low_gradients(self) -> bool:
        """Whether the next :meth:`step` reads the low-precision gradients where they are
        (fused, no master holds a gradient): a loss scaler must then check those."""
        if self.fused is False or self._fused is None:
            return False
        if any(master.grad is not None for _, master in self._pairs):
            return False
        return self._fused.can_run([p for g in self.param_groups for p in g["params"]])

    def _step_unscaling(self, grad_scale: torch.Tensor) -> None:
        """:meth:`step` on gradients multiplied by the scale ``grad_scale``: unscaled by
        its float32 reciprocal (computed in float64, as ``GradScaler.unscale_`` does),
        inside the fused kernel where it runs. No check for inf/NaN: the caller's."""
        self._step(grad_scale.double().reciprocal().float())

    @torch.no_grad()
    def _step(self, inv_scale: torch.Tensor | None) -> None:
        if self._takes_low_gradients():
            assert self._fused is not None
            grads, lows = self._fused_gradients()
            self._fused.step(grads, lows, inv_scale)
            for param, _ in self._pairs:
                param.grad = None
            return
        self.grads_to_masters()
        stepped = [p for g in self.param_groups for p in g["params"]]
        if inv_scale is not None:
            by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for p in stepped:
                if p.grad is not None:
                    by_kind.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
            for (device, _), same in by_kind.items():
                found = torch.zeros((), device=device)  # checked by the caller already
                amp_unscale_and_check_(same, found, inv_scale.to(device))
        if self._fused is not None and self.fused is not False and self._fused.can_run(stepped):
            master_grads = {p: p.grad for p in stepped if p.grad is not None}
            self._fused.step(master_grads, {m: p for p, m in self._pairs}, None)
        else:
            self.optimizer.step()
            self.masters_to_model()
        for _, master in self._pairs:
            master.grad = None

    def _fused_gradients(
        self,
    ) -> tuple[dict[torch.Tensor, torch.Tensor], dict[torch.Tensor, torch.Tensor]]:
        """Each stepped tensor's gradient (a master's is its parameter's), and each
        master's low-precision parameter."""
        lows = {master: param for param, master in self._pairs}
        grads = {}
        for group in self.param_groups:
            for stepped in group["params"]:
                low = lows.get(stepped)
                grad = (low if low is not None else stepped).grad
                if grad is not None:
                    grads[stepped] = grad
        return grads, lows

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the masters' gradients (and the inner optimizer's float32 ones)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for param, _ in self._pairs:
            if param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.zero_()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the inner optimizer, with a float32 master for each
        low-precision parameter; unset hyper-parameters come from the user's
        ``defaults``, as with the plain optimizer."""
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        stepped, added = [], []
        for param in params:
            if param.dtype in (torch.float16, torch.bfloat16):
                master = _master_for(param, None)
                added.append((param, master))
                param = master
            stepped.append(param)
        self.optimizer.add_param_group({**param_group, "params": stepped})
        self._pairs += added
        if self._fused is not None:
            self._lay_out(added)

    # --- checkpoints -----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict: float32 state, laid out as without masters."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)
        if self._fused is not None:  # loaded state: laid out again for the fused step
            masters = [m for _, m in self._pairs]  # (chunks keep masters apart from the rest)
            state_layout.lay_out(self.optimizer.state, masters, self._fused.keys)
            self._fused = FusedMasterStep(self.optimizer, strict=bool(self.fused))

    def __getstate__(self) -> dict[str, Any]:
        # torch's Optimizer pickles defaults, state and param groups only; here those
        # are the inner optimizer's, which travels whole, with the pairs.
        return {"optimizer": self.optimizer, "_pairs": self._pairs, "fused": self.fused}

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("fused", False)  # pickled before the fused step
        self.__dict__.update(state)
        fused = self.fused is not False and unsupported(self.optimizer) is None
        self._fused = FusedMasterStep(self.optimizer, bool(self.fused)) if fused else None
        init_optimizer_hooks(self)

    def __repr__(self) -> str:
        return f"MasterWeightOptimizer({len(self._pairs)} masters, {self.optimizer!r})"


def _master_for(param: torch.Tensor, start: torch.Tensor | None) -> torch.Tensor:
    """A float32 leaf tensor to step in ``param``'s place."""
    if start is None:
        master = param.detach().to(torch.float32, copy=True)
    else:
        if start.shape != param.shape or start.dtype is not torch.float32:
            raise value_error(
                "A master weight must be a float32 tensor of its parameter's shape "
                f"{tuple(param.shape)}",
                "(master.shape, master.dtype)",
                (tuple(start.shape), start.dtype),
            )
        master = start.detach()
    return master.requires_grad_(param.requires_grad)
