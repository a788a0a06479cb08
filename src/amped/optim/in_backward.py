"""Optimizer in backward: step each parameter as its gradient is ready, then free the gradient.

:func:`step_in_backward` registers a hook on every parameter of a bf16-pure optimizer
(``torch.Tensor.register_post_accumulate_grad_hook``, as torchtune does) that steps
that parameter and sets its gradient to None. No gradient outlives its hook, so the
model holds no gradient buffer between backward and step: under ``bf16-pure-8bit``,
weights and state cost 4.03 bytes a parameter, against 6.03 with the gradients (see
:func:`amped.memory_report`, which counts the gradients of such an optimizer as
transient, the largest one at a time).

The loop stays the same: ``setup.backward(loss)`` steps the parameters, and
``setup.step()`` (or ``optimizer.step()``) closes the step (it finds no gradient left).
Every parameter is stepped with the same arithmetic as in an ordinary step, so the
result is the ordinary step's: bitwise for :class:`~amped.optim.adamw8bit.CompensatedAdamW8bit`
(its random bits do not depend on the order of the parameters) and for
``CompensatedSGD`` under Kahan compensation (no random bits). Wherever
:class:`~amped.optim.CompensatedAdamW` and ``CompensatedSGD`` round stochastically
(the weights under ``"stochastic"``, AdamW's second moment under both) they draw their
bits per ``step()`` call, here once per parameter, so they round differently from the
ordinary step (equally unbiased). Each hook is one ``step()`` call for them: their
fused kernel is compiled per chunk shape, so pass ``fused=False`` if there are many
shapes.

Gradient clipping (``max_norm``): the whole gradient's norm is known only after the last
hook, when every parameter has stepped, so each step is clipped by the *previous*
step's total norm: gradients are multiplied by ``min(1, max_norm / (norm + 1e-6))``
before stepping, with ``norm`` the 2-norm of the previous step's unclipped gradients
(:attr:`InBackward.last_norm`). The first step is not clipped. A spike is thus clipped
one step late; the norm stays on the device (no sync). The norm travels in the
optimizer's ``state_dict()`` (under ``"in_backward"``) and comes back with
``load_state_dict()`` while the hooks are on, so a run resumed from a checkpoint clips
its first step as the uninterrupted run does (bitwise): call :func:`step_in_backward`
before loading (it warns if the optimizer already holds state and ``max_norm`` is set).

Cannot combine with gradient accumulation (several backward passes per step: the first
one steps already; a parameter hooked twice before a step raises RuntimeError), nor with
clipping or unscaling gradients between backward and step (there are none left), nor
with :func:`amped.monitor`, which checks the gradients in ``setup.step()``, after the
hooks have stepped them and freed them: either order of the two is refused with a
``ValueError``.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch

from amped._internal.errors import type_error, value_error
from amped.optim.adamw8bit import CompensatedAdamW8bit
from amped.optim.compensated import CompensatedAdamW, CompensatedSGD
from amped.optim.shards import is_sharded

__all__ = ["InBackward", "in_backward", "set_monitored", "step_in_backward"]

_ACTIVE: weakref.WeakKeyDictionary[torch.optim.Optimizer, InBackward] = weakref.WeakKeyDictionary()
# Optimizers whose setup a monitor watches (amped.recipes.monitoring registers them).
_MONITORED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_STATE_KEY = "in_backward"
_MONITOR_CONFLICT = (
    "amped.monitor checks each step's gradients in setup.step(), before the optimizer "
    "steps; under step_in_backward every parameter steps inside backward and its "
    "gradient is freed before setup.step(), so a non-finite gradient would reach the "
    "weights unchecked. Use one or the other: remove the hooks (hooks.remove()) to "
    "monitor, or detach the monitor (monitor.detach()) to step in backward"
)
_OPTIMIZERS = (CompensatedAdamW8bit, CompensatedAdamW, CompensatedSGD)


class InBackward:
    """The hooks of :func:`step_in_backward` on one optimizer; :meth:`remove` takes them off."""

    def __init__(self, optimizer: torch.optim.Optimizer, max_norm: float | None) -> None:
        self.optimizer = optimizer
        self.max_norm = max_norm
        self.last_norm: torch.Tensor | None = None
        """The 2-norm of the last completed step's gradients (before clipping)."""
        self._squares: torch.Tensor | None = None
        self._stepped: set[int] = set()
        self._handles: list[Any] = []
        self._in_hook = False  # step() calls from a hook do not close the step
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.requires_grad:
                    self._handles.append(param.register_post_accumulate_grad_hook(self._hook))
        self._handles.append(optimizer.register_step_post_hook(self._close))
        self._handles.append(optimizer.register_state_dict_post_hook(self._save_norm))
        self._handles.append(optimizer.register_load_state_dict_pre_hook(self._load_norm))

    @torch.no_grad()
    def _hook(self, param: torch.Tensor) -> None:
        if id(param) in self._stepped:
            raise RuntimeError(
                "A parameter received a second gradient before the optimizer's step: "
                "optimizer-in-backward steps each parameter in backward, so it cannot "
                "accumulate gradients over several backward passes. Call setup.step() "
                "after every backward, or remove the hooks (handle.remove()) and step "
                "ordinarily"
            )
        self._stepped.add(id(param))
        grad = param.grad
        assert grad is not None  # the hook runs after accumulation
        square = grad.float().square().sum()
        self._squares = square if self._squares is None else self._squares + square
        if self.max_norm is not None and self.last_norm is not None:
            grad.mul_((self.max_norm / (self.last_norm + 1e-6)).clamp(max=1.0).to(grad.dtype))
        if isinstance(self.optimizer, CompensatedAdamW8bit):
            self.optimizer.step_parameter(param)
        else:
            self._in_hook = True
            try:
                self.optimizer.step()  # only this parameter has a gradient now
            finally:
                self._in_hook = False
        param.grad = None

    def _close(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """After the optimizer's step: the step is over; keep its norm for clipping."""
        if self._in_hook:
            return
        if self._stepped:
            assert self._squares is not None
            self.last_norm = self._squares.sqrt()
        self._squares = None
        self._stepped.clear()

    def _save_norm(
        self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
    ) -> dict[str, Any]:
        """``optimizer.state_dict()`` carries the clipping norm of the last step."""
        norm = None if self.last_norm is None else self.last_norm.detach().clone()
        state_dict[_STATE_KEY] = {"last_norm": norm}
        return state_dict

    def _load_norm(
        self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
    ) -> dict[str, Any]:
        """``optimizer.load_state_dict()`` restores the clipping norm (before torch reads
        the rest, which has no such key)."""
        entry = state_dict.get(_STATE_KEY)
        if entry is None:
            return state_dict
        norm = entry.get("last_norm") if isinstance(entry, dict) else None
        if norm is not None and not (isinstance(norm, torch.Tensor) and norm.numel() == 1):
            raise value_error(
                "The optimizer state's in_backward entry holds the clipping norm of the "
                "last step: a 1-element tensor or None. Load a state written by "
                "optimizer.state_dict() under step_in_backward",
                "state_dict['in_backward']['last_norm']",
                norm,
            )
        self.last_norm = None if norm is None else norm.detach().clone().reshape(())
        return {key: value for key, value in state_dict.items() if key != _STATE_KEY}

    def remove(self) -> None:
        """Take the hooks off: the optimizer steps ordinarily again."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        _ACTIVE.pop(self.optimizer, None)


def step_in_backward(
    optimizer: torch.optim.Optimizer, *, max_norm: float | None = None
) -> InBackward:
    """Step ``optimizer``'s parameters in backward, each as its gradient is ready (see
    the module for clipping and what it cannot combine with).

    Args:
        optimizer: a bf16-pure optimizer (``setup.optimizer`` of ``bf16-pure``,
            ``bf16-pure-sr`` or ``bf16-pure-8bit``).
        max_norm: clip each step's gradients by the previous step's total 2-norm.

    Example:
        >>> import torch, amped
        >>> model = torch.nn.Linear(256, 32)
        >>> setup = amped.prepare(model, torch.optim.AdamW(model.parameters()), "bf16-pure-8bit")
        >>> hooks = amped.optim.step_in_backward(setup.optimizer, max_norm=1.0)
        >>> setup.backward(setup.model(torch.randn(3, 256, dtype=torch.bfloat16)).float().sum())
        >>> model.weight.grad is None, setup.step()
        (True, True)
    """
    if not isinstance(optimizer, _OPTIMIZERS):
        raise type_error(
            "step_in_backward() takes a bf16-pure optimizer (CompensatedAdamW8bit, "
            "CompensatedAdamW or CompensatedSGD: setup.optimizer of a bf16-pure recipe)",
            "type(optimizer)",
            type(optimizer),
        )
    if max_norm is not None and (not isinstance(max_norm, (int, float)) or max_norm <= 0):
        raise value_error("max_norm must be a positive number or None", "max_norm", max_norm)
    sharded = [p for g in optimizer.param_groups for p in g["params"] if is_sharded(p)]
    if sharded:
        # FSDP2 reduce-scatters after backward and sets the sharded gradients itself: no
        # accumulate-grad hook of a sharded parameter runs, and a norm would be local.
        raise value_error(
            "step_in_backward() steps each parameter from a gradient hook, which FSDP2's "
            "sharded parameters never run (fully_shard sets their gradients after its "
            "reduce-scatter); step FSDP2 models with setup.step()",
            "type(param)",
            type(sharded[0]).__name__,
        )
    if optimizer in _ACTIVE:
        raise value_error(
            "This optimizer steps in backward already; remove() its hooks first",
            "optimizer",
            type(optimizer).__name__,
        )
    if optimizer in _MONITORED:
        raise value_error(_MONITOR_CONFLICT, "optimizer", type(optimizer).__name__)
    if max_norm is not None and optimizer.state:
        warnings.warn(
            "step_in_backward(max_norm=...) on an optimizer that already holds state (it "
            "stepped, or loaded a checkpoint): the clipping norm of its last step is not "
            "known, so the next step is not clipped. To resume bitwise, call "
            "step_in_backward before optimizer.load_state_dict (the norm is in the state "
            "the hooks save)",
            RuntimeWarning,
            stacklevel=2,
        )
    hooks = InBackward(optimizer, None if max_norm is None else float(max_norm))
    _ACTIVE[optimizer] = hooks
    return hooks


def in_backward(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` steps in backward (its gradients are transient)."""
    return optimizer in _ACTIVE


def set_monitored(optimizer: torch.optim.Optimizer, monitored: bool) -> None:
    """Record that a monitor checks ``optimizer``'s gradients at ``setup.step()`` (or no
    longer does): :func:`step_in_backward` refuses it meanwhile.

    Raises:
        ValueError: ``optimizer`` steps in backward already.
    """
    if not monitored:
        _MONITORED.discard(optimizer)
        return
    if optimizer in _ACTIVE:
        raise value_error(_MONITOR_CONFLICT, "optimizer", type(optimizer).__name__)
    _MONITORED.add(optimizer)
