"""SGD and AdamW for low-precision weights and state, with compensated updates (bf16-pure).

Each optimizer follows torch's algorithm (``torch.optim.SGD``, ``torch.optim.AdamW``
and ``torch.optim.Adam``'s L2 form) with two changes: the arithmetic runs in float32,
and the update reaches the low-precision weight through
:func:`~amped.optim.rounding.kahan_add_` or
:func:`~amped.optim.rounding.stochastic_round_`, so updates smaller than half a
bfloat16 ulp are not lost. The state (momentum, moments, compensation) has the
parameter's dtype: with bfloat16 weights, every tensor of the optimizer is bfloat16.
Float32 parameters are updated plainly.

How a step runs. The parameters that have a gradient are cut into chunks of one
device and dtype, in parameter order (:class:`~amped.optim.chunks.Plan`), whose work
tensors take at most ``_CHUNK_BYTES``; a larger contiguous parameter is cut into
pieces, any other goes alone. A chunk's gradients, weights and state are copied into
flat float32 work rows (:class:`~amped.optim.chunks.Chunk`), each stage of the
algorithm runs as one op over the whole chunk, and the results are copied back.
That saves the per-tensor dispatch (microseconds an op: most of the step for small
tensors; torch's ``_foreach`` ops on the CPU loop over the tensors with the same
dispatch) and the per-tensor float32 temporaries. Every element meets the same
float32 ops with the same operands as when each tensor is stepped on its own, so the
results are bitwise those of the per-tensor algorithm
(``tests/optim/test_recipes_compensated_reference.py`` holds them to it).

Stochastic rounding takes its random bits from :mod:`amped.optim.noise`: one
``random_`` call a step on the optimizer's seeded generator draws a key per write, and
the bits of each element come from hashing its number, in vectorized integer ops.
The generator's state is still the whole random state (``state_dict()["rng_state"]``).

Memory: the work rows (4 bytes per element for each float32 row, three for SGD, four
for AdamW, and each int32 row: one per write that may round stochastically plus two)
take ``_CHUNK_BYTES`` (8 MiB) per device, or more if a non-contiguous parameter is
larger. They are kept between steps while the parameters, their gradients' presence
and layouts stay the same. The step never synchronizes with the device.

The fused step (``fused=None``, the default, or ``True``): where every bfloat16
parameter of the step can take it (:mod:`amped.optim.fused` says when), the
bfloat16 parameters are cut into larger chunks (``_FUSED_CHUNK_BYTES``) and
each chunk is stepped by one compiled kernel, which reads the low-precision values and
writes them back in place, with no float32 rows. Its gradients and weights are
gathered into rows of the chunk's dtype (kept like the work rows), its state is used
where it lies: the state of parameters that start stepping together is created as
views of one tensor per key (:mod:`amped.optim.state_layout`), so a chunk's state is
one slice of memory. float16 and float32 parameters take the eager step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from amped._internal.errors import value_error
from amped._internal.torch_compat import foreach_add_, foreach_copy_, python_mode_active
from amped.optim import fused as fused_kernels
from amped.optim import state_layout
from amped.optim.chunks import Chunk, Groups, Plan
from amped.optim.noise import draw_keys, hashed_noise_
from amped.optim.rounding import Compensation, rounded_with_noise_
from amped.optim.seeded import SeededOptimizer, adamw_defaults, check_number
from amped.optim.shards import is_sharded

__all__ = ["CompensatedAdamW", "CompensatedSGD"]

_SLOW_DECAY = 2.0**-6  # 1 - decay below this: four bfloat16 ulps or fewer per step
_LOW_DTYPES = (torch.bfloat16, torch.float16)
_FUSED = torch.bfloat16  # the fused step's dtype (amped.optim.fused says why only it)
# Work memory of a chunk: small enough to stay in a server CPU's last-level cache from
# one op to the next, with the chunk's state beside it; large enough that dispatch (a
# few microseconds an op) is a small part. Measured on the development machine (32 MiB
# L3), 4-layer encoder, against 2**18 elements: AdamW 9% slower at 2**16, the same at
# 2**17 to 2**19, 4% and 23% slower at 2**20 and 2**22; SGD similar (2**19 7% faster,
# 2**20 20% slower).
_CHUNK_BYTES = 8 << 20
# The fused step reads each value once, so its chunks need not stay in cache between
# ops: larger chunks save per-call costs (the compiled call, the copies' dispatch).
# Encoder shapes (3.2 M elements), 2 threads: 7.7 ms a step in chunks of 233 k
# elements, 5.6 ms in chunks of 930 k, 4.9 ms in one. Gather rows take 2 bytes an
# element per column (4 with the state laid out flat, 10 at most, for AdamW).
_FUSED_CHUNK_BYTES = 32 << 20
# A parameter this large is a fused chunk of its own: its gradient, weight and state
# are then flat already, and its three copies (gradient and weight in, weight out)
# are saved, for one more compiled call. A call costs about 55 us (1 thread), the
# copies about 0.15 ns an element each: worth it from about 10**5 elements, and
# clearly from 2**20 (measured on the encoder's shapes: isolating its 65 k to 262 k
# tensors made the Kahan step 15% slower and the stochastic one 8% faster).
_ALONE = 1 << 20
_GRAD, _WEIGHT = 0, 1  # the float32 work rows every chunk has (see Chunk)


class _Step:
    """What one step shares among its chunks: the random keys (drawn on first use, one
    per write), and the parameters whose momentum buffer starts this step (SGD)."""

    def __init__(self, optimizer: _CompensatedOptimizer) -> None:
        self.optimizer = optimizer
        self.fresh: set[torch.Tensor] = set()
        self.new_state: list[state_layout.Request] = []  # created together, after _prepare
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


class _CompensatedOptimizer(SeededOptimizer):
    """What both optimizers share: the chunked step, writing updates and state, the
    random stream."""

    _WORK_FLOATS = 4  # float32 rows a chunk needs; _GRAD and _WEIGHT first
    _STATE_KEYS: tuple[str, ...] = ()  # the state tensors shaped like the parameter
    _WORK_NOISE = 3  # int32 rows: one per write that may round stochastically

    def __init__(
        self, params: Iterable[Any], defaults: dict[str, Any], seed: int, fused: bool | None
    ) -> None:
        super().__init__(params, defaults, seed, fused)
        self._plan = Plan(self._WORK_FLOATS, self._WORK_NOISE)
        # Chunks of the fused step: no float32 rows; each gathers into rows of its own.
        self._fused_plan = Plan(self._WORK_FLOATS, self._WORK_NOISE, rows=False, alone=_ALONE)

    def _draw(
        self, chunk: Chunk, group: dict, write: int, decay: float | None, step: _Step
    ) -> int | None:
        """``write`` if that write of ``chunk`` rounds stochastically, with its random
        bits drawn into ``chunk.noise[write]``; else None. Stochastic are the update
        (``decay=None``) under stochastic compensation, and slow running averages
        (see ``_store``)."""
        if not self._stochastic(chunk, group, decay):
            return None
        start = step.keys(chunk.device)[write] + chunk.first
        hashed_noise_(chunk.noise[write], chunk.counters, start, chunk.scratch)
        return write

    @staticmethod
    def _stochastic(chunk: Chunk, group: dict, decay: float | None) -> bool:
        """Whether a write of ``chunk`` rounds stochastically (see ``_draw``): the weight
        (``decay=None``) under stochastic compensation, a running average whose
        per-step change ``1 - decay`` is below 2**-6 under either (see ``_store``)."""
        if chunk.dtype is not torch.bfloat16:
            return False
        if decay is None:
            return group["compensation"] == "stochastic"
        return 1 - decay < _SLOW_DECAY

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
        stochastically (unbiased) under either compensation, and faster-moving ones
        (the first moment, ``1 - 0.9``) to nearest under either: their per-step change
        is many ulps, so rounding them to nearest loses nothing that stochastic
        rounding would keep, and spares its random bits (amped < 0.2 rounded every
        moment stochastically under ``compensation="stochastic"``). The row's NaNs may
        be made canonical; its numbers are kept.
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
            # (nothing, for a weight at +-inf: inf - inf must not become its compensation)
            total.nan_to_num_(nan=0.0, posinf=math.inf, neginf=-math.inf)
            foreach_copy_(compensations, chunk.views[_WEIGHT])

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_plan"] = state["_fused_plan"] = None  # work memory: rebuilt at the next step
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._plan = Plan(self._WORK_FLOATS, self._WORK_NOISE)
        self._fused_plan = Plan(self._WORK_FLOATS, self._WORK_NOISE, rows=False, alone=_ALONE)

    def _loaded(self, state_dict: dict[str, Any]) -> None:
        low = [p for g in self.param_groups for p in g["params"] if p.dtype is _FUSED]
        state_layout.lay_out(self.state, low, self._STATE_KEYS)  # for the fused step
        # Chunks keep views of the old state's memory: let it go now, not at the next step.
        self._fused_plan = Plan(self._WORK_FLOATS, self._WORK_NOISE, rows=False, alone=_ALONE)

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
        state_layout.allocate(self.state, step.new_state)
        eager = groups
        if self._fusable(groups, step):
            low = [(g, [p for p in params if p.dtype is _FUSED]) for g, params in groups]
            eager = [(g, [p for p in params if p.dtype is not _FUSED]) for g, params in groups]
            # Each column (gradients, weights, a state) may need a 2-byte row to gather in.
            most = _FUSED_CHUNK_BYTES // (2 * (2 + len(self._STATE_KEYS)))
            for group, chunk in self._fused_plan.chunks(low, most, self._splittable):
                if chunk.numel < 2 or not self._step_fused(chunk, group, step):
                    self._step_chunk(self._plan.twin(chunk), group, step)  # eager after all
        most = _CHUNK_BYTES // (4 * (self._WORK_FLOATS + self._WORK_NOISE + 2))
        for group, chunk in self._plan.chunks(eager, most, self._splittable):
            self._step_chunk(chunk, group, step)
        return loss

    def _fusable(self, groups: Groups, step: _Step) -> bool:
        """Whether this step takes the fused kernels (:mod:`amped.optim.fused`)."""
        if self.fused is False or torch.compiler.is_compiling() or python_mode_active():
            return False  # under a user's torch.compile, Dynamo fuses the eager step
        low = [(g, p) for g, params in groups for p in params if p.dtype is _FUSED]
        plain = [state_layout.plain(p) or is_sharded(p) for _, p in low]
        if not low or not all(plain):
            return False  # nothing to fuse, or tensor subclasses: eager
        # (FSDP2's DTensors fuse: each chunk is one shard's local rows; see chunks)
        for device_type in {param.device.type for _, param in low}:
            reason = fused_kernels.available(device_type)
            if reason is not None:
                if self.fused:
                    raise RuntimeError(
                        f"fused=True cannot run here: {reason}. Pass fused=None (the eager "
                        "step where the fused one cannot run) or fused=False"
                    )
                return False
        return self._fusable_params(low, step)

    def _fusable_params(self, low: list[tuple[dict, torch.Tensor]], step: _Step) -> bool:
        """Whether the kernel covers these (group, low-precision parameter) pairs."""
        raise NotImplementedError

    def _starts(self, chunk: Chunk, step: _Step, stochastic: bool) -> torch.Tensor:
        """Each write's first random number for ``chunk`` (zeros if none rounds
        stochastically, so that the random stream is not drawn, as in ``_draw``)."""
        if stochastic:
            return step.keys(chunk.device) + chunk.first_number()
        return torch.zeros(self._WORK_NOISE, dtype=torch.int32, device=chunk.device)

    def _step_fused(self, chunk: Chunk, group: dict, step: _Step) -> bool:
        """Step ``chunk`` with the fused kernel; False to leave it to the eager step."""
        raise NotImplementedError

    def _run_fused(
        self,
        chunk: Chunk,
        kernel: Callable[..., bool],
        keys: tuple[str, ...],
        kahan: bool,
        scalars: list[float],
        starts: torch.Tensor,
        flags: tuple[bool, ...],
    ) -> bool:
        """Call ``kernel`` (:mod:`amped.optim.fused`) on ``chunk``'s gradients, weights,
        state ``keys`` and (under Kahan) compensations, each as a flat row: its own memory
        where the tensors lie back to back (state is laid out so:
        :mod:`amped.optim.state_layout`), else gathered into a work row and, if the
        kernel writes it, copied back after. False if the kernel could not be compiled."""
        states = [self.state[param] for param in chunk.owners]
        grads = [param.grad for param in chunk.owners if param.grad is not None]
        columns = [(grads, False), (chunk.owners, True)]
        for key in (*keys, "compensation") if kahan else keys:
            columns.append(([state[key] for state in states], True))
        rows, back = [], []
        for slot, (tensors, written) in enumerate(columns):
            parts = chunk.take(tensors)
            # Gradients and weights (the first two) are the user's: looked at afresh.
            row = state_layout.flat(parts) if slot < 2 else chunk.flat(slot, parts)
            if row is None:
                row, views = chunk.gather_row(slot)
                foreach_copy_(views, parts)
                if written:
                    back.append((parts, views))
            rows.append(row)
        compensation = rows[-1] if kahan else rows[1]  # unused under stochastic rounding
        values = torch.tensor(scalars, dtype=torch.float32, device=chunk.device)
        args = (*rows[: 2 + len(keys)], compensation, values, starts)
        if not kernel(chunk.device.type, bool(self.fused), args, flags):
            return False
        for parts, views in back:
            foreach_copy_(parts, views)
        return True

    def _prepare(self, param: torch.Tensor, group: dict, step: _Step) -> None:
        """Create ``param``'s state before its first step; count the step."""
        state = self.state[param]
        kahan = group["compensation"] == "kahan" and param.dtype in _LOW_DTYPES
        if kahan and "compensation" not in state:
            step.new_state.append((param, "compensation", True))

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
            ``"stochastic"`` (stochastic rounding of the weights; no buffer). Under both,
            the momentum buffer rounds stochastically when ``1 - momentum`` is below
            2**-6, else to nearest.
        seed: seeds the stochastic rounding's random stream.
        fused: ``None`` (default): step bfloat16 weights with one compiled kernel per
            chunk (:mod:`amped.optim.fused`) where torch.compile can build it, else
            eagerly, with one warning; ``True``: an error instead where it cannot;
            ``False``: always eager. Steps the kernel does not cover (the module says
            which) are eager under all three.

    Example:
        >>> import torch, amped
        >>> model = torch.nn.Linear(4, 2).bfloat16()
        >>> opt = amped.optim.CompensatedSGD(model.parameters(), lr=1e-4, momentum=0.9)
        >>> model(torch.randn(3, 4, dtype=torch.bfloat16)).float().sum().backward()
        >>> opt.step()
        >>> sorted(opt.state[model.weight])
        ['compensation', 'momentum_buffer']
    """

    _WORK_FLOATS = 3  # rows: the gradient (then the update), the weight, the velocity
    _STATE_KEYS = ("momentum_buffer", "compensation")
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
        fused: bool | None = None,
    ) -> None:
        if nesterov and (momentum <= 0 or dampening != 0):
            wrong = ("momentum", momentum) if momentum <= 0 else ("dampening", dampening)
            raise value_error("Nesterov momentum requires momentum > 0 and dampening = 0", *wrong)
        defaults = dict(
            lr=check_number("lr", lr),
            momentum=check_number("momentum", momentum),
            dampening=check_number("dampening", dampening),
            weight_decay=check_number("weight_decay", weight_decay),
            nesterov=bool(nesterov),
            maximize=bool(maximize),
            compensation=compensation,
        )
        super().__init__(params, defaults, seed, fused)

    def _prepare(self, param: torch.Tensor, group: dict, step: _Step) -> None:
        super()._prepare(param, group, step)
        state = self.state[param]
        if group["momentum"] != 0 and "momentum_buffer" not in state:
            step.new_state.append((param, "momentum_buffer", False))
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

    def _fusable_params(self, low: list[tuple[dict, torch.Tensor]], step: _Step) -> bool:
        # Without momentum there is nothing to fuse (three ops); on torch's first step
        # the buffer is the gradient.
        return all(g["momentum"] != 0 and p not in step.fresh for g, p in low)

    def _step_fused(self, chunk: Chunk, group: dict, step: _Step) -> bool:
        momentum = group["momentum"]  # not 0, and every buffer exists (_fusable_params)
        kahan = group["compensation"] == "kahan"
        stochastic_buffer = self._stochastic(chunk, group, momentum)
        scalars = [
            -1.0 if group["maximize"] else 1.0,
            group["weight_decay"],
            momentum,
            1 - group["dampening"],
            -group["lr"],
        ]
        starts = self._starts(chunk, step, stochastic_buffer or not kahan)
        flags = (kahan, stochastic_buffer, group["nesterov"])
        keys = ("momentum_buffer",)
        return self._run_fused(chunk, fused_kernels.sgd_, keys, kahan, scalars, starts, flags)

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
            ``"stochastic"`` (stochastic rounding of the weights; no buffer). Under both,
            a moment rounds stochastically when its ``1 - beta`` is below 2**-6 (the
            second moment's, by default: round-to-nearest would freeze its decay; see
            ``_store``), else to nearest.
        seed: seeds the stochastic rounding's random stream.
        fused: ``None`` (default): step bfloat16 weights with one compiled kernel per
            chunk (:mod:`amped.optim.fused`) where torch.compile can build it, else
            eagerly, with one warning; ``True``: an error instead where it cannot;
            ``False``: always eager. Steps the kernel does not cover (the module says
            which) are eager under all three.
            The two agree to the last bit but for rare roundings (the module says which).

    The step count is a Python int in the state (torch keeps a float32 tensor, which
    stops counting exactly at 2**24 steps).

    Example:
        >>> import torch, amped
        >>> model = torch.nn.Linear(4, 2).bfloat16()
        >>> opt = amped.optim.CompensatedAdamW(model.parameters(), lr=1e-4)
        >>> model(torch.randn(3, 4, dtype=torch.bfloat16)).float().sum().backward()
        >>> opt.step()
        >>> opt.state[model.weight]["exp_avg_sq"].dtype
        torch.bfloat16
    """

    # Rows: the gradient, the weight, the first moment (then the update), the second.
    _EXP_AVG, _EXP_AVG_SQ = 2, 3
    _STATE_KEYS = ("exp_avg", "exp_avg_sq", "compensation")

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
        fused: bool | None = None,
    ) -> None:
        defaults = adamw_defaults(
            lr, betas, eps, weight_decay, decoupled_weight_decay, maximize, compensation
        )
        super().__init__(params, defaults, seed, fused)

    def _prepare(self, param: torch.Tensor, group: dict, step: _Step) -> None:
        super()._prepare(param, group, step)
        state = self.state[param]
        if "step" not in state:
            state["step"] = 0
            step.new_state += [(param, "exp_avg", True), (param, "exp_avg_sq", True)]
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

    def _fusable_params(self, low: list[tuple[dict, torch.Tensor]], step: _Step) -> bool:
        # Per-tensor bias corrections (a parameter that missed steps): the eager step.
        counts: dict[int, int] = {}
        for group, param in low:
            if counts.setdefault(id(group), self.state[param]["step"]) != self.state[param]["step"]:
                return False
        return True

    def _step_fused(self, chunk: Chunk, group: dict, step: _Step) -> bool:
        count = self.state[chunk.owners[0]]["step"]  # the chunk's (_fusable_params)
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        decoupled = group["decoupled_weight_decay"]
        kahan = group["compensation"] == "kahan"
        stochastic_avg = self._stochastic(chunk, group, beta1)
        stochastic_avg_sq = self._stochastic(chunk, group, beta2)
        scalars = [
            -1.0 if group["maximize"] else 1.0,
            0.0 if decoupled else wd,
            1 - beta1,
            beta2,
            1 - beta2,
            math.sqrt(1 - beta2**count),
            eps,
            -lr / (1 - beta1**count),
            -lr * wd if decoupled else 0.0,
        ]
        stochastic = stochastic_avg or stochastic_avg_sq or not kahan
        starts = self._starts(chunk, step, stochastic)
        flags = (kahan, stochastic_avg, stochastic_avg_sq)
        keys = ("exp_avg", "exp_avg_sq")
        return self._run_fused(chunk, fused_kernels.adamw_, keys, kahan, scalars, starts, flags)
