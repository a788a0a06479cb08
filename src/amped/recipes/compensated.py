"""SGD and AdamW for low-precision weights and state, with compensated updates (bf16-pure).

Each optimizer follows torch's algorithm (``torch.optim.SGD``, ``torch.optim.AdamW``
and ``torch.optim.Adam``'s L2 form) with two changes: the arithmetic runs in float32,
and the update reaches the low-precision weight through
:func:`~amped.recipes.rounding.kahan_add_` or
:func:`~amped.recipes.rounding.stochastic_round_`, so updates smaller than half a
bfloat16 ulp are not lost. The state (momentum, moments, compensation) has the
parameter's dtype: with bfloat16 weights, every tensor of the optimizer is bfloat16.
Float32 parameters are updated plainly.

How a step runs. A group's parameters are taken in chunks of one device and dtype, in
parameter order, whose work tensors take at most ``_CHUNK_BYTES`` (a larger tensor
makes a chunk of its own). A chunk's gradients, weights and state are copied into
flat float32 work tensors (:class:`~amped.recipes.chunks.Chunk`), each stage of the
algorithm runs as one op over the whole chunk, and the results are copied back. That
saves the per-tensor dispatch (microseconds an op: most of the step for small tensors)
and the per-tensor float32 temporaries, which the allocator hands back to the system and faults in
again. Every element meets the same float32 ops with the same operands as when each
tensor is stepped on its own, so the results are bitwise those of the per-tensor
algorithm (``tests/test_recipes_compensated_reference.py`` holds them to it), and
stochastic rounding draws its random integers as that algorithm does, one ``randint``
per tensor and write, in parameter order, so the random stream is unchanged too.

The transient memory is bounded by the chunk, not the model: 4 bytes per element for
each float32 work tensor (three for SGD, four for AdamW) and each int32 noise tensor
(one per write that may round stochastically: two for SGD, three for AdamW), 20 or 28
bytes per element in all, for the largest chunk: at most ``_CHUNK_BYTES`` (8 MiB), or
20 or 28 bytes per element of the largest tensor if it has more than
``_CHUNK_BYTES / 20`` or ``/ 28`` elements (420,000 or 300,000). The step never
synchronizes with the device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from amped._internal.errors import received, type_error, value_error
from amped.recipes.chunks import Chunk, allocate, partition
from amped.recipes.registry import Compensation
from amped.recipes.rounding import draw_noise_, require_bfloat16, rounded_with_noise_

__all__ = ["CompensatedAdamW", "CompensatedSGD"]

_COMPENSATIONS = ("kahan", "stochastic")
_SLOW_DECAY = 2.0**-6  # 1 - decay below this: four bfloat16 ulps or fewer per step
_LOW_DTYPES = (torch.bfloat16, torch.float16)
# Work memory of a chunk: small enough to stay in a server CPU's last-level cache from
# one op to the next, with the chunk's state beside it; large enough that dispatch (a
# few microseconds an op) is a small part. Measured on the development machine (32 MiB
# L3), 4-layer encoder, against 2**18 elements: AdamW 9% slower at 2**16, the same at
# 2**17 to 2**19, 4% and 23% slower at 2**20 and 2**22; SGD similar (2**19 7% faster,
# 2**20 20% slower).
_CHUNK_BYTES = 8 << 20
_GRAD, _WEIGHT = 0, 1  # the float32 work rows every chunk has (see Chunk)


def _check(name: str, value: float, low: float = 0.0, high: float | None = None) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise type_error(f"{name} must be a number", name, value)
    if value < low or (high is not None and value >= high):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise value_error(f"{name} must be {bound}", name, value)
    return float(value)


class _CompensatedOptimizer(torch.optim.Optimizer):
    """What both optimizers share: the chunked step, writing updates and state, the
    random stream."""

    _WORK_FLOATS = 4  # float32 rows a chunk needs; _GRAD and _WEIGHT first
    _WORK_NOISE = 3  # int32 rows: one per write that may round stochastically

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], seed: int) -> None:
        if defaults["compensation"] not in _COMPENSATIONS:
            raise value_error(
                f"compensation must be one of {list(_COMPENSATIONS)}",
                "compensation",
                defaults["compensation"],
            )
        super().__init__(params, defaults)
        self.seed = seed
        self._generator: torch.Generator | None = None

    def _rng(self, device: torch.device) -> torch.Generator:
        if self._generator is None:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
        return self._generator

    def _stochastic(self, chunk: Chunk, group: dict, decay: float | None) -> bool:
        """Whether a write rounds stochastically: the update (``decay=None``) under
        stochastic compensation, or a running average (see ``_store``)."""
        if chunk.dtype is not torch.bfloat16:
            return False
        return group["compensation"] == "stochastic" or (
            decay is not None and 1 - decay < _SLOW_DECAY
        )

    def _draw(self, chunk: Chunk, stochastic: list[bool]) -> list[torch.Tensor | None]:
        """Noise for each write of the step that rounds stochastically, else None.

        The per-tensor algorithm draws one ``randint`` per tensor and write, tensor by
        tensor; drawn here in that order, the stream and each draw are unchanged.
        """
        rows = iter(chunk.noise)
        noise = [next(rows) if flag else None for flag in stochastic]
        drawn = [chunk.parts(row) for row in noise if row is not None]
        if drawn:
            generator = self._rng(chunk.device)
            for parts in zip(*drawn, strict=True):
                for part in parts:
                    draw_noise_(part, generator)
        return noise

    def _store(
        self,
        chunk: Chunk,
        buffers: list[torch.Tensor],
        row: int,
        noise: torch.Tensor | None,
    ) -> None:
        """Write float32 running averages (``buffer * decay + ...``, work row ``row``)
        into their buffers; ``noise``, if any, rounds them stochastically.

        A bfloat16 ulp is 2**-8 to 2**-7 of the value, so an average whose per-step
        change ``1 - decay`` is below ~4 ulps (AdamW's second moment, ``1 - 0.999``)
        rounds to nearest with a bias: with 1 - decay < 2**-9 it stops decaying at all,
        stays too large and shrinks the steps. Measured on the test task: AdamW with
        round-to-nearest moments ended 3000 steps at twice fp32's loss; with the second
        moment stochastically rounded it matched fp32. So such averages are rounded
        stochastically (unbiased) even under Kahan compensation (``_stochastic``). The
        row's NaNs may be made canonical; its numbers are kept.
        """
        if noise is None:
            torch._foreach_copy_(buffers, chunk.views[row])
        else:
            torch._foreach_copy_(buffers, chunk.cut(rounded_with_noise_(chunk.floats[row], noise)))

    def _apply_update(
        self, chunk: Chunk, update: int, spare: int, noise: torch.Tensor | None
    ) -> None:
        """``param += update`` (work row ``update``), compensated if the chunk is low.

        Row ``_WEIGHT`` holds the weights in float32; rows ``update``, ``_WEIGHT`` and
        ``spare`` are consumed.
        """
        params, weight = chunk.params, chunk.floats[_WEIGHT]
        if chunk.dtype not in _LOW_DTYPES:
            torch._foreach_add_(params, chunk.views[update])
        elif noise is not None:
            value = chunk.floats[update].add_(weight)
            torch._foreach_copy_(params, chunk.cut(rounded_with_noise_(value, noise)))
        else:  # kahan_add_ on the chunk, stage by stage: see its comments for why
            compensations = []
            for param in params:
                state = self.state[param]
                if "compensation" not in state:
                    state["compensation"] = torch.zeros_like(
                        param, memory_format=torch.preserve_format
                    )
                compensations.append(state["compensation"])
            scratch, scratches = chunk.floats[spare], chunk.views[spare]
            torch._foreach_copy_(scratches, compensations)
            # The update plus what earlier steps failed to add, then the weight.
            total = weight.add_(chunk.floats[update].add_(scratch))
            torch._foreach_copy_(params, chunk.views[_WEIGHT])  # rounds once, to nearest
            torch._foreach_copy_(scratches, params)
            total.sub_(scratch)  # what the rounding lost, exactly
            torch._foreach_copy_(compensations, chunk.views[_WEIGHT])

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
        most = _CHUNK_BYTES // (4 * (self._WORK_FLOATS + self._WORK_NOISE))
        plan = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for param in params:  # refuse before anything is written
                self._refuse(param, group)
            plan += [(group, chunk) for chunk in partition(params, most)]
        for group, chunk in allocate(plan, self._WORK_FLOATS, self._WORK_NOISE):
            self._step_chunk(chunk, group)
        return loss

    def _refuse(self, param: torch.Tensor, group: dict) -> None:
        if param.grad is not None and param.grad.is_sparse:
            raise RuntimeError(
                f"{type(self).__name__} does not support sparse gradients. "
                + received("grad.layout", param.grad.layout)
            )
        if group["compensation"] == "stochastic" and param.dtype in _LOW_DTYPES:
            require_bfloat16(param.dtype)

    def _load(self, chunk: Chunk, group: dict) -> None:
        """The gradients (negated to maximize) and the weights, in float32."""
        grads = [p.grad for p in chunk.params if p.grad is not None]  # all: see step()
        torch._foreach_copy_(chunk.views[_GRAD], grads)
        if group["maximize"]:
            chunk.floats[_GRAD].neg_()
        torch._foreach_copy_(chunk.views[_WEIGHT], chunk.params)

    def _step_chunk(self, chunk: Chunk, group: dict) -> None:
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

    _WORK_FLOATS = 3  # rows: the gradient (then the update), the weight, the velocity
    _WORK_NOISE = 2  # the momentum buffer and the weight may round stochastically
    _VELOCITY = 2

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
            wrong = ("momentum", momentum) if momentum <= 0 else ("dampening", dampening)
            raise value_error("Nesterov momentum requires momentum > 0 and dampening = 0", *wrong)
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

    def _step_chunk(self, chunk: Chunk, group: dict) -> None:
        momentum = group["momentum"]
        noise_velocity, noise_weight = self._draw(
            chunk,
            [
                momentum != 0 and self._stochastic(chunk, group, momentum),
                self._stochastic(chunk, group, None),
            ],
        )
        self._load(chunk, group)
        grad, weight, velocity = chunk.floats
        if group["weight_decay"] != 0:
            grad.add_(weight, alpha=group["weight_decay"])
        if momentum != 0:
            self._momentum(chunk, group, noise_velocity)
            if group["nesterov"]:
                velocity = grad.add_(velocity, alpha=momentum)
            torch.mul(velocity, -group["lr"], out=grad)
        else:
            grad.mul_(-group["lr"])
        self._apply_update(chunk, _GRAD, self._VELOCITY, noise_weight)

    def _momentum(self, chunk: Chunk, group: dict, noise: torch.Tensor | None) -> None:
        """velocity = momentum * buffer + (1 - dampening) * grad, stored in the buffers."""
        grad, _, velocity = chunk.floats
        states = [self.state[param] for param in chunk.params]
        fresh = ["momentum_buffer" not in state for state in states]
        for param, state, new in zip(chunk.params, states, fresh, strict=True):
            if new:
                state["momentum_buffer"] = torch.empty_like(param)
        buffers = [state["momentum_buffer"] for state in states]
        views = chunk.views[self._VELOCITY]
        if all(fresh):  # torch's first step: the buffer starts as the gradient
            velocity.copy_(grad)
        else:
            torch._foreach_copy_(
                [v for v, new in zip(views, fresh, strict=True) if not new],
                [b for b, new in zip(buffers, fresh, strict=True) if not new],
            )
            velocity.mul_(group["momentum"]).add_(grad, alpha=1 - group["dampening"])
            for view, grad_view, new in zip(views, chunk.views[_GRAD], fresh, strict=True):
                if new:  # a parameter that had no gradient before
                    view.copy_(grad_view)
        self._store(chunk, buffers, self._VELOCITY, noise)


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

    # Rows: the gradient, the weight, the first moment (then the update), the second.
    _EXP_AVG, _EXP_AVG_SQ = 2, 3

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

    def _step_chunk(self, chunk: Chunk, group: dict) -> None:
        states = [self.state[param] for param in chunk.params]
        for param, state in zip(chunk.params, states, strict=True):
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["step"] += 1
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        noise_avg, noise_avg_sq, noise_weight = self._draw(
            chunk,
            [self._stochastic(chunk, group, d) for d in (beta1, beta2, None)],
        )
        self._load(chunk, group)
        grad, weight, exp_avg, exp_avg_sq = chunk.floats
        if wd != 0 and not group["decoupled_weight_decay"]:
            grad.add_(weight, alpha=wd)
        torch._foreach_copy_(chunk.views[self._EXP_AVG], [s["exp_avg"] for s in states])
        exp_avg.lerp_(grad, 1 - beta1)
        torch._foreach_copy_(chunk.views[self._EXP_AVG_SQ], [s["exp_avg_sq"] for s in states])
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        self._store(chunk, [s["exp_avg"] for s in states], self._EXP_AVG, noise_avg)
        self._store(chunk, [s["exp_avg_sq"] for s in states], self._EXP_AVG_SQ, noise_avg_sq)
        # torch's bias corrections, in Python floats (double precision), per tensor:
        # a parameter that had no gradient at some steps has a smaller step count.
        steps = [state["step"] for state in states]
        denom = exp_avg_sq.sqrt_()
        if len(set(steps)) == 1:
            denom.div_(math.sqrt(1 - beta2 ** steps[0])).add_(eps)
            update = exp_avg.div_(denom).mul_(-lr / (1 - beta1 ** steps[0]))
        else:
            for view, step in zip(chunk.views[self._EXP_AVG_SQ], steps, strict=True):
                view.div_(math.sqrt(1 - beta2**step))
            update = exp_avg.div_(denom.add_(eps))
            for view, step in zip(chunk.views[self._EXP_AVG], steps, strict=True):
                view.mul_(-lr / (1 - beta1**step))
        if wd != 0 and group["decoupled_weight_decay"]:
            # AdamW's param *= 1 - lr * wd, as an update: lr * wd (1e-5 typically) is far
            # below half a bfloat16 ulp, so it must go through the compensated add too.
            update.add_(weight, alpha=-lr * wd)
        self._apply_update(chunk, self._EXP_AVG, _GRAD, noise_weight)
