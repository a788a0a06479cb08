"""SGD and AdamW for low-precision weights and state, with compensated updates (bf16-pure).

Each optimizer follows torch's algorithm (``torch.optim.SGD``, ``torch.optim.AdamW``
and ``torch.optim.Adam``'s L2 form) with two changes: the arithmetic of one parameter
tensor runs in float32, and the update reaches the low-precision weight through
:func:`~amped.recipes.rounding.kahan_add_` or
:func:`~amped.recipes.rounding.stochastic_round_`, so updates smaller than half a
bfloat16 ulp are not lost. The state (momentum, moments, compensation) has the
parameter's dtype: with bfloat16 weights, every tensor of the optimizer is bfloat16.
Float32 parameters are updated plainly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from amped.recipes.registry import Compensation
from amped.recipes.rounding import kahan_add_, stochastic_round_

__all__ = ["CompensatedAdamW", "CompensatedSGD"]

_COMPENSATIONS = ("kahan", "stochastic")
_SLOW_DECAY = 2.0**-6  # 1 - decay below this: four bfloat16 ulps or fewer per step


def _check(name: str, value: float, low: float = 0.0, high: float | None = None) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(
            f"{name} must be a number. Received: {name}={value!r} (of type {type(value).__name__})"
        )
    if value < low or (high is not None and value >= high):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}. Received: {name}={value!r}")
    return float(value)


class _CompensatedOptimizer(torch.optim.Optimizer):
    """What both optimizers share: writing updates and state, the random stream."""

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], seed: int) -> None:
        if defaults["compensation"] not in _COMPENSATIONS:
            raise ValueError(
                f"compensation must be one of {list(_COMPENSATIONS)}. "
                f"Received: compensation={defaults['compensation']!r}"
            )
        super().__init__(params, defaults)
        self.seed = seed
        self._generator: torch.Generator | None = None

    def _rng(self, device: torch.device) -> torch.Generator:
        if self._generator is None:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
        return self._generator

    def _apply_update(
        self, param: torch.Tensor, update: torch.Tensor, state: dict[str, Any], group: dict
    ) -> None:
        """``param += update`` (float32 ``update``, consumed), compensated if ``param`` is low."""
        if param.dtype not in (torch.bfloat16, torch.float16):
            param.add_(update)
        elif group["compensation"] == "kahan":
            if "compensation" not in state:
                state["compensation"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            kahan_add_(param, update, state["compensation"])
        else:
            stochastic_round_(param, update.add_(param), self._rng(param.device))

    def _store(self, buffer: torch.Tensor, value: torch.Tensor, group: dict, decay: float) -> None:
        """Write a float32 running average (``buffer * decay + ...``) into its buffer.

        A bfloat16 ulp is 2**-8 to 2**-7 of the value, so an average whose per-step
        change ``1 - decay`` is below ~4 ulps (AdamW's second moment, ``1 - 0.999``)
        rounds to nearest with a bias: with 1 - decay < 2**-9 it stops decaying at all,
        stays too large and shrinks the steps. Measured on the test task: AdamW with
        round-to-nearest moments ended 3000 steps at twice fp32's loss; with the second
        moment stochastically rounded it matched fp32. So such averages are rounded
        stochastically (unbiased) even under Kahan compensation.
        """
        stochastic = group["compensation"] == "stochastic" or 1 - decay < _SLOW_DECAY
        if buffer.dtype is torch.bfloat16 and stochastic:
            stochastic_round_(buffer, value, self._rng(buffer.device))
        else:
            buffer.copy_(value)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["seed"] = self.seed
        state["_generator"] = None
        state["_rng_state"] = None if self._generator is None else self._generator.get_state()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        rng_state = state.pop("_rng_state", None)
        super().__setstate__(state)
        if rng_state is not None:
            device = next(p.device for g in self.param_groups for p in g["params"])
            self._rng(device).set_state(rng_state)

    def state_dict(self) -> dict[str, Any]:
        """torch's layout, plus the random stream's state under ``"rng_state"``."""
        state = super().state_dict()
        state["seed"] = self.seed
        if self._generator is not None:
            state["rng_state"] = self._generator.get_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        rng_state = state_dict.pop("rng_state", None)
        self.seed = state_dict.pop("seed", self.seed)
        super().load_state_dict(state_dict)
        self._generator = None
        if rng_state is not None:
            device = next(p.device for g in self.param_groups for p in g["params"])
            self._rng(device).set_state(rng_state)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError(
                        f"{type(self).__name__} does not support sparse gradients. "
                        f"Received: a sparse gradient for a parameter of shape "
                        f"{tuple(param.shape)}"
                    )
                grad = param.grad.to(torch.float32, copy=True)
                if group["maximize"]:
                    grad.neg_()
                self._step_one(param, grad, self.state[param], group)
        return loss

    def _step_one(
        self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict
    ) -> None:
        raise NotImplementedError


class CompensatedSGD(_CompensatedOptimizer):
    """``torch.optim.SGD`` (momentum, dampening, Nesterov, L2 weight decay) for bf16 weights.

    Args:
        params: parameters or parameter groups, as for any torch optimizer.
        lr, momentum, dampening, weight_decay, nesterov, maximize: as in ``torch.optim.SGD``.
        compensation: ``"kahan"`` (a compensation buffer per weight, in its dtype) or
            ``"stochastic"`` (stochastic rounding of weights and momentum; no buffer).
        seed: seeds the stochastic rounding's random stream.

    Example:
        >>> import torch, amped
        >>> model = torch.nn.Linear(4, 2).bfloat16()
        >>> opt = amped.recipes.CompensatedSGD(model.parameters(), lr=1e-4, momentum=0.9)
        >>> model(torch.randn(3, 4, dtype=torch.bfloat16)).float().sum().backward()
        >>> opt.step()
        >>> sorted(opt.state[model.weight])
        ['compensation', 'momentum_buffer']
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        compensation: Compensation = "kahan",
        seed: int = 0,
    ) -> None:
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError(
                "Nesterov momentum requires momentum > 0 and dampening = 0. "
                f"Received: momentum={momentum!r}, dampening={dampening!r}"
            )
        defaults = dict(
            lr=_check("lr", lr),
            momentum=_check("momentum", momentum),
            dampening=_check("dampening", dampening),
            weight_decay=_check("weight_decay", weight_decay),
            nesterov=bool(nesterov),
            maximize=bool(maximize),
            compensation=compensation,
        )
        super().__init__(params, defaults, seed)

    def _step_one(
        self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict
    ) -> None:
        if group["weight_decay"] != 0:
            grad.add_(param, alpha=group["weight_decay"])
        momentum = group["momentum"]
        if momentum != 0:
            buf = state.get("momentum_buffer")
            if buf is None:  # torch's first step: the buffer starts as the gradient
                buf = state["momentum_buffer"] = torch.empty_like(param)
                velocity = grad.clone()
            else:
                velocity = buf.to(torch.float32, copy=True).mul_(momentum)
                velocity.add_(grad, alpha=1 - group["dampening"])
            self._store(buf, velocity, group, momentum)
            grad = grad.add_(velocity, alpha=momentum) if group["nesterov"] else velocity
        self._apply_update(param, grad.mul_(-group["lr"]), state, group)


class CompensatedAdamW(_CompensatedOptimizer):
    """``torch.optim.AdamW`` (or ``Adam`` with ``decoupled_weight_decay=False``) for bf16 weights.

    Args:
        params: parameters or parameter groups, as for any torch optimizer.
        lr, betas, eps, weight_decay, maximize: as in ``torch.optim.AdamW``.
        decoupled_weight_decay: True for AdamW's decay (shrink the weight), False for
            Adam's L2 term (add ``weight_decay * param`` to the gradient).
        compensation: ``"kahan"`` (a compensation buffer per weight, in its dtype) or
            ``"stochastic"`` (stochastic rounding of weights and both moments; no buffer).
            Under both, the second moment is stochastically rounded when ``1 - betas[1]``
            is below 2**-6 (see ``_store``): round-to-nearest would freeze its decay.
        seed: seeds the stochastic rounding's random stream.

    The step count is a Python int in the state (torch keeps a float32 tensor, which
    stops counting exactly at 2**24 steps).

    Example:
        >>> import torch, amped
        >>> model = torch.nn.Linear(4, 2).bfloat16()
        >>> opt = amped.recipes.CompensatedAdamW(model.parameters(), lr=1e-4)
        >>> model(torch.randn(3, 4, dtype=torch.bfloat16)).float().sum().backward()
        >>> opt.step()
        >>> opt.state[model.weight]["exp_avg_sq"].dtype
        torch.bfloat16
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        decoupled_weight_decay: bool = True,
        maximize: bool = False,
        compensation: Compensation = "kahan",
        seed: int = 0,
    ) -> None:
        defaults = dict(
            lr=_check("lr", lr),
            betas=(_check("betas[0]", betas[0], high=1.0), _check("betas[1]", betas[1], high=1.0)),
            eps=_check("eps", eps),
            weight_decay=_check("weight_decay", weight_decay),
            decoupled_weight_decay=bool(decoupled_weight_decay),
            maximize=bool(maximize),
            compensation=compensation,
        )
        super().__init__(params, defaults, seed)

    def _step_one(
        self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict
    ) -> None:
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["step"] += 1
        step, lr, wd = state["step"], group["lr"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        if wd != 0 and not group["decoupled_weight_decay"]:
            grad.add_(param, alpha=wd)
        exp_avg = state["exp_avg"].to(torch.float32, copy=True).lerp_(grad, 1 - beta1)
        exp_avg_sq = state["exp_avg_sq"].to(torch.float32, copy=True).mul_(beta2)
        exp_avg_sq.addcmul_(grad, grad, value=1 - beta2)
        self._store(state["exp_avg"], exp_avg, group, beta1)
        self._store(state["exp_avg_sq"], exp_avg_sq, group, beta2)
        # torch's bias corrections, in Python floats (double precision).
        step_size = lr / (1 - beta1**step)
        denom = exp_avg_sq.sqrt_().div_(math.sqrt(1 - beta2**step)).add_(group["eps"])
        update = exp_avg.div_(denom).mul_(-step_size)
        if wd != 0 and group["decoupled_weight_decay"]:
            # AdamW's param *= 1 - lr * wd, as an update: lr * wd (1e-5 typically) is far
            # below half a bfloat16 ulp, so it must go through the compensated add too.
            update.add_(param, alpha=-lr * wd)
        self._apply_update(param, update, state, group)
