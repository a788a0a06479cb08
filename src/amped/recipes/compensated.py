"""SGD and AdamW for low-precision weights and state, with compensated updates (bf16-pure).

Each optimizer follows torch's algorithm (``torch.optim.SGD``, ``torch.optim.AdamW``
and ``torch.optim.Adam``'s L2 form) with two changes: the arithmetic runs in float32,
and the update reaches the low-precision weight through
:func:`~amped.recipes.rounding.kahan_add_` or
:func:`~amped.recipes.rounding.stochastic_round_`, so updates smaller than half a
bfloat16 ulp are not lost. The state (momentum, moments, compensation) has the
parameter's dtype: with bfloat16 weights, every tensor of the optimizer is bfloat16.
Float32 parameters are updated plainly.

How a step runs. The parameters that have a gradient are cut into chunks of one
device and dtype, in parameter order (:class:`~amped.recipes.chunks.Plan`), whose work
tensors take at most ``_CHUNK_BYTES``; a larger contiguous parameter is cut into
pieces, any other goes alone. A chunk's gradients, weights and state are copied into
flat float32 work rows (:class:`~amped.recipes.chunks.Chunk`), each stage of the
algorithm runs as one op over the whole chunk, and the results are copied back.
That saves the per-tensor dispatch (microseconds an op: most of the step for small
tensors; torch's ``_foreach`` ops on the CPU loop over the tensors with the same
dispatch) and the per-tensor float32 temporaries. Every element meets the same
float32 ops with the same operands as when each tensor is stepped on its own, so the
results are bitwise those of the per-tensor algorithm
(``tests/test_recipes_compensated_reference.py`` holds them to it).

Stochastic rounding takes its random bits from :mod:`amped.recipes.noise`: one
``random_`` call a step on the optimizer's seeded generator draws a key per write, and
the bits of each element come from hashing its number, in vectorized integer ops.
The generator's state is still the whole random state (``state_dict()["rng_state"]``).

Memory: the work rows (4 bytes per element for each float32 row, three for SGD, four
for AdamW, and each int32 row: one per write that may round stochastically plus two)
take ``_CHUNK_BYTES`` (8 MiB) per device, or more if a non-contiguous parameter is
larger. They are kept between steps while the parameters, their gradients' presence
and layouts stay the same. The step never synchronizes with the device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from amped._internal.errors import received, type_error, value_error
from amped._internal.torch_compat import foreach_add_, foreach_copy_
from amped.recipes.chunks import Chunk, Plan
from amped.recipes.noise import draw_keys, hashed_noise_
from amped.recipes.registry import Compensation
from amped.recipes.rounding import require_bfloat16, rounded_with_noise_

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


class _Step:
    """What one step shares among its chunks: the random keys (drawn on first use, one
    per write), and the parameters whose momentum buffer starts this step (SGD)."""

    def __init__(self, optimizer: _CompensatedOptimizer) -> None:
        self.optimizer = optimizer
        self.fresh: set[torch.Tensor] = set()
        self._keys: dict[torch.device, torch.Tensor] = {}

    def keys(self, device: torch.device) -> torch.Tensor:
        if not self._keys:
            generator = self.optimizer._rng(device)
            drawn = draw_keys(self.optimizer._WORK_NOISE, generator)
            self._keys[generator.device] = drawn
        if device not in self._keys:
            first = next(iter(self._keys.values()))
            self._keys[device] = first.to(device, non_blocking=True)
        return self._keys[device]


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
        self._plan = Plan(self._WORK_FLOATS, self._WORK_NOISE)

    def _rng(self, device: torch.device) -> torch.Generator:
        if self._generator is None:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
        return self._generator

    def _draw(
        self, chunk: Chunk, group: dict, write: int, decay: float | None, step: _Step
    ) -> int | None:
        """``write`` if that write of ``chunk`` rounds stochastically, with its random
        bits drawn into ``chunk.noise[write]``; else None. Stochastic are the update
        (``decay=None``) under stochastic compensation, and slow running averages
        (see ``_store``)."""
        if chunk.dtype is not torch.bfloat16:
            return None
        if group["compensation"] != "stochastic" and (decay is None or 1 - decay >= _SLOW_DECAY):
            return None
        start = step.keys(chunk.device)[write] + chunk.first
        hashed_noise_(chunk.noise[write], chunk.counters, start, chunk.scratch)
        return write

    @staticmethod
    def _rounded(chunk: Chunk, value: torch.Tensor, write: int) -> list[torch.Tensor]:
        """Float32 row ``value`` rounded stochastically with the bits of ``write``, as
        the chunk's parts (each a bfloat16 value exactly)."""
        rounded_with_noise_(value, chunk.noise[write])
        return chunk.rounded[write]

    def _store(
        self, chunk: Chunk, buffers: list[torch.Tensor], row: int, write: int | None
    ) -> None:
        """Write float32 running averages (``buffer * decay + ...``, work row ``row``)
        into their buffers (the chunk's parts), rounded stochastically if ``write`` is
        given (see ``_draw``).

        A bfloat16 ulp is 2**-8 to 2**-7 of the value, so an average whose per-step
        change ``1 - decay`` is below ~4 ulps (AdamW's second moment, ``1 - 0.999``)
        rounds to nearest with a bias: with 1 - decay < 2**-9 it stops decaying at all,
        stays too large and shrinks the steps. Measured on the test task: AdamW with
        round-to-nearest moments ended 3000 steps at twice fp32's loss; with the second
        moment stochastically rounded it matched fp32. So such averages are rounded
        stochastically (unbiased) even under Kahan compensation. The row's NaNs may be
        made canonical; its numbers are kept.
        """
        if write is None:
            foreach_copy_(buffers, chunk.views[row])
        else:
            foreach_copy_(buffers, self._rounded(chunk, chunk.floats[row], write))

    def _apply_update(self, chunk: Chunk, update: int, spare: int, write: int | None) -> None:
        """``param += update`` (work row ``update``), compensated if the chunk is low,
        rounded stochastically if ``write`` is given (see ``_draw``).

        Row ``_WEIGHT`` holds the weights in float32; rows ``update``, ``_WEIGHT`` and
        ``spare`` are consumed.
        """
        params, weight = chunk.take(chunk.owners), chunk.floats[_WEIGHT]
        if chunk.dtype not in _LOW_DTYPES:
            foreach_add_(params, chunk.views[update])
        elif write is not None:
            value = chunk.floats[update].add_(weight)
            foreach_copy_(params, self._rounded(chunk, value, write))
        else:  # kahan_add_ on the chunk, stage by stage: see its comments for why
            compensations = chunk.take([self.state[p]["compensation"] for p in chunk.owners])
            # (A float32 op with a bfloat16 operand would save the copies to float32,
            # but torch runs mixed dtypes unvectorized: 0.48 against 0.29 ns/element.)
            scratch, scratches = chunk.floats[spare], chunk.views[spare]
            foreach_copy_(scratches, compensations)
            # The update plus what earlier steps failed to add, then the weight.
            total = weight.add_(chunk.floats[update].add_(scratch))
            foreach_copy_(params, chunk.views[_WEIGHT])  # rounds once, to nearest
            foreach_copy_(scratches, params)
            total.sub_(scratch)  # what the rounding lost, exactly
            foreach_copy_(compensations, chunk.views[_WEIGHT])

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["seed"] = self.seed
        state["_generator"] = None
        state["_rng_state"] = None if self._generator is None else self._generator.get_state()
        state["_plan"] = None  # work memory: rebuilt at the next step
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        rng_state = state.pop("_rng_state", None)
        super().__setstate__(state)
        self._plan = Plan(self._WORK_FLOATS, self._WORK_NOISE)
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
        groups = [(g, [p for p in g["params"] if p.grad is not None]) for g in self.param_groups]
        for group, params in groups:
            for param in params:  # refuse before anything is written
                self._refuse(param, group)
        step = _Step(self)
        for group, params in groups:
            for param in params:
                self._prepare(param, group, step)
        most = _CHUNK_BYTES // (4 * (self._WORK_FLOATS + self._WORK_NOISE + 2))
        for group, chunk in self._plan.chunks(groups, most, self._splittable):
            self._step_chunk(chunk, group, step)
        return loss

    def _refuse(self, param: torch.Tensor, group: dict) -> None:
        if param.grad is not None and param.grad.is_sparse:
            raise RuntimeError(
                f"{type(self).__name__} does not support sparse gradients. "
                + received("grad.layout", param.grad.layout)
            )
        if group["compensation"] == "stochastic" and param.dtype in _LOW_DTYPES:
            require_bfloat16(param.dtype)

    def _prepare(self, param: torch.Tensor, group: dict, step: _Step) -> None:
        """Create ``param``'s state before its first step; count the step."""
        state = self.state[param]
        kahan = group["compensation"] == "kahan" and param.dtype in _LOW_DTYPES
        if kahan and "compensation" not in state:
            state["compensation"] = torch.zeros_like(param, memory_format=torch.preserve_format)

    def _splittable(self, param: torch.Tensor) -> bool:
        """Whether ``param`` may be cut into pieces: it, its gradient and its state are
        laid out alike, as flat memory."""
        tensors = [param, param.grad, *self.state.get(param, {}).values()]
        return all(t.is_contiguous() for t in tensors if isinstance(t, torch.Tensor))

    def _load(self, chunk: Chunk, group: dict) -> None:
        """The gradients (negated to maximize) and the weights, in float32."""
        grads = chunk.take([p.grad for p in chunk.owners if p.grad is not None])  # all
        foreach_copy_(chunk.views[_GRAD], grads)
        if group["maximize"]:
            chunk.floats[_GRAD].neg_()
        foreach_copy_(chunk.views[_WEIGHT], chunk.take(chunk.owners))

    def _step_chunk(self, chunk: Chunk, group: dict, step: _Step) -> None:
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

    def _prepare(self, param: torch.Tensor, group: dict, step: _Step) -> None:
        super()._prepare(param, group, step)
        state = self.state[param]
        if group["momentum"] != 0 and "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.empty_like(param)
            step.fresh.add(param)

    def _step_chunk(self, chunk: Chunk, group: dict, step: _Step) -> None:
        momentum = group["momentum"]
        self._load(chunk, group)
        grad, weight, velocity = chunk.floats
        if group["weight_decay"] != 0:
            grad.add_(weight, alpha=group["weight_decay"])
        if momentum != 0:
            self._momentum(chunk, group, self._draw(chunk, group, 0, momentum, step), step)
            if group["nesterov"]:
                velocity = grad.add_(velocity, alpha=momentum)
            torch.mul(velocity, -group["lr"], out=grad)
        else:
            grad.mul_(-group["lr"])
        write = self._draw(chunk, group, 1, None, step)
        self._apply_update(chunk, _GRAD, self._VELOCITY, write)

    def _momentum(self, chunk: Chunk, group: dict, write: int | None, step: _Step) -> None:
        """velocity = momentum * buffer + (1 - dampening) * grad, stored in the buffers."""
        grad, _, velocity = chunk.floats
        fresh = [param in step.fresh for param in chunk.owners]
        buffers = chunk.take([self.state[param]["momentum_buffer"] for param in chunk.owners])
        views = chunk.views[self._VELOCITY]
        if all(fresh):  # torch's first step: the buffer starts as the gradient
            velocity.copy_(grad)
        else:
            foreach_copy_(
                [v for v, new in zip(views, fresh, strict=True) if not new],
                [b for b, new in zip(buffers, fresh, strict=True) if not new],
            )
            velocity.mul_(group["momentum"]).add_(grad, alpha=1 - group["dampening"])
            for view, grad_view, new in zip(views, chunk.views[_GRAD], fresh, strict=True):
                if new:  # a parameter that had no gradient before
                    view.copy_(grad_view)
        self._store(chunk, buffers, self._VELOCITY, write)


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

    def _prepare(self, param: torch.Tensor, group: dict, step: _Step) -> None:
        super()._prepare(param, group, step)
        state = self.state[param]
        if "step" not in state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["step"] += 1

    def _step_chunk(self, chunk: Chunk, group: dict, step: _Step) -> None:
        states = [self.state[param] for param in chunk.owners]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        self._load(chunk, group)
        grad, weight, exp_avg, exp_avg_sq = chunk.floats
        if wd != 0 and not group["decoupled_weight_decay"]:
            grad.add_(weight, alpha=wd)
        avg_buffers = chunk.take([s["exp_avg"] for s in states])
        foreach_copy_(chunk.views[self._EXP_AVG], avg_buffers)
        exp_avg.lerp_(grad, 1 - beta1)
        avg_sq_buffers = chunk.take([s["exp_avg_sq"] for s in states])
        foreach_copy_(chunk.views[self._EXP_AVG_SQ], avg_sq_buffers)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        self._store(chunk, avg_buffers, self._EXP_AVG, self._draw(chunk, group, 0, beta1, step))
        write = self._draw(chunk, group, 1, beta2, step)
        self._store(chunk, avg_sq_buffers, self._EXP_AVG_SQ, write)
        # torch's bias corrections, in Python floats (double precision), per tensor:
        # a parameter that had no gradient at some steps has a smaller step count.
        steps = [state["step"] for state in states]
        denom = exp_avg_sq.sqrt_()
        if len(set(steps)) == 1:
            denom.div_(math.sqrt(1 - beta2 ** steps[0])).add_(eps)
            update = exp_avg.div_(denom).mul_(-lr / (1 - beta1 ** steps[0]))
        else:
            for view, count in zip(chunk.views[self._EXP_AVG_SQ], steps, strict=True):
                view.div_(math.sqrt(1 - beta2**count))
            update = exp_avg.div_(denom.add_(eps))
            for view, count in zip(chunk.views[self._EXP_AVG], steps, strict=True):
                view.mul_(-lr / (1 - beta1**count))
        if wd != 0 and group["decoupled_weight_decay"]:
            # AdamW's param *= 1 - lr * wd, as an update: lr * wd (1e-5 typically) is far
            # below half a bfloat16 ulp, so it must go through the compensated add too.
            update.add_(weight, alpha=-lr * wd)
        self._apply_update(chunk, self._EXP_AVG, _GRAD, self._draw(chunk, group, 2, None, step))
