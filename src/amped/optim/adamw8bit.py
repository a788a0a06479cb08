"""AdamW with 8-bit moments for bfloat16 weights (``bf16-pure-8bit``).

:class:`CompensatedAdamW8bit` is ``torch.optim.AdamW`` (or Adam's L2 form) with three
changes: the arithmetic runs in float32; the moments of a large tensor are kept
blockwise quantized to 8 bits (:mod:`amped.optim.quantized_state`: 256-element
blocks, the dynamic map of bitsandbytes and torchao), those of a small one in float32;
and the update reaches a bfloat16 weight through stochastic rounding (the default) or
Kahan compensation, as in :class:`~amped.optim.CompensatedAdamW`. With stochastic
rounding a bfloat16 parameter costs 2 bytes of weight, 2 of gradient and 2.03 of state
(two 1-byte codes and two float32 scales per 256 elements).

The moments follow torchao's ``AdamW8bit`` op for op (dequantize, ``lerp`` towards the
gradient and its square, quantize), so that from the same gradients the two hold the
same codes; the update is AdamW's, from the float32 moments before quantization.

**Bounded steps (the default).** Quantized moments can disagree: a rarely used
embedding row's second moment, small against its block's largest, is flushed to code
0 while its first moment survives, and the row then steps ``lr * m / eps`` (hundreds of
``lr``; training diverges at learning rates where float32 AdamW trains). Exact Adam
cannot step that far. From ``m_t = (1 - b1) sum_i b1**(t-i) g_i`` and ``v_t = (1 - b2)
sum_i b2**(t-i) g_i**2`` (``m_0 = v_0 = 0``), Cauchy-Schwarz on ``b1**k = (b1 /
sqrt(b2))**k * sqrt(b2)**k`` gives, for every element and every gradient sequence::

    |m_t| / sqrt(v_t) <= (1 - b1) * sqrt(S_t / (1 - b2)),   S_t = sum_{k<t} (b1**2 / b2)**k

so ``|m_hat / (sqrt(v_hat) + eps)|`` is at most that times ``sqrt(1 - b2**t) / (1 - b1**t)``
(1 at the first step, 7.27 at most for the default betas). With ``bounded=True`` each
element of a quantized tensor's ``m / (sqrt(v_hat) + eps)`` is clamped to that bound
(:func:`step_bound`) before the learning rate multiplies it: a step exact Adam could
take is left as it is, bit for bit; the codes and scales stay torchao's. With
``bounded=False`` the step is torchao's ``AdamW8bit`` as it is.

State, per parameter: ``step`` (a Python int) and, for a quantized tensor,
``exp_avg_codes`` and ``exp_avg_sq_codes`` (uint8, the parameter's shape) with
``exp_avg_scale`` and ``exp_avg_sq_scale`` (float32, one per block); for a small one,
``exp_avg`` and ``exp_avg_sq`` (float32); under Kahan, ``compensation``.
:meth:`CompensatedAdamW8bit.moments` gives the moments as float32 tensors.

Each parameter is stepped on its own (:meth:`CompensatedAdamW8bit.step_parameter`),
which optimizer-in-backward (:mod:`amped.optim.in_backward`) calls from the gradient
hook. Stochastic rounding draws one key a step from the optimizer's seeded generator;
element ``i`` of the parameter that starts ``offset`` elements into the optimizer's
parameters (in group order) gets the bits of ``hash(key + offset + i)``
(:mod:`amped.optim.noise`), so the noise does not depend on the order in which
parameters are stepped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from amped._internal.errors import type_error, value_error
from amped._internal.torch_compat import python_mode_active
from amped.optim import fused as fused_kernels
from amped.optim import quantized_state as q8
from amped.optim import sharded_state
from amped.optim.adamw8bit_fused import adamw8bit_
from amped.optim.noise import draw_keys, hashed_noise_
from amped.optim.rounding import Compensation, kahan_add_, rounded_with_noise_
from amped.optim.seeded import SeededOptimizer, adamw_defaults
from amped.optim.shards import flat_start, is_sharded, local, rebuild

__all__ = ["CompensatedAdamW8bit", "step_bound"]

_LOW_DTYPES = (torch.bfloat16, torch.float16)
# The fused step takes a large tensor in pieces of this many elements (whole blocks):
# its kernel holds float32 intermediates of a piece (about 22 bytes an element), so
# stepping a tensor at once would need them for all of it (92 MiB for a 2048 x 2048
# weight, more than its 8-bit state). A piece costs one more call, about 50 us.
_FUSED_PIECE = 1 << 18


def step_bound(beta1: float, beta2: float, step: int) -> float:
    """The largest ``|m / (sqrt(v_hat) + eps)|`` exact Adam reaches at ``step`` (1, 2,
    ...), for any gradients: ``(1 - beta1) * sqrt(S * (1 - beta2**step) / (1 - beta2))``
    with ``S = sum_{k<step} (beta1**2 / beta2)**k`` (the module derives it). Times
    ``lr / (1 - beta1**step)`` it bounds an element's step. Inf where it overflows."""
    ratio = beta1 * beta1 / beta2
    try:
        total = float(step) if ratio == 1.0 else (1.0 - ratio**step) / (1.0 - ratio)
        return (1 - beta1) * math.sqrt(total * (1.0 - beta2**step) / (1.0 - beta2))
    except OverflowError:  # beta1**2 > beta2 and a step count large enough
        return math.inf


def _int32(number: int) -> int:
    """``number`` (below 2**32) as the int32 with its bits: element numbers wrap."""
    return number - (1 << 32) if number >= (1 << 31) else number


def _pieces(numel: int) -> list[tuple[int, int]]:
    """``[first, end)`` element ranges of the fused step's pieces of a quantized tensor;
    a tail shorter than ``MIN_QUANTIZED`` joins the piece before it (a one-block piece
    would make torch.compile specialize and build the kernel again)."""
    pieces, first = [], 0
    while first < numel:
        end = min(first + _FUSED_PIECE, numel)
        if numel - end < q8.MIN_QUANTIZED:
            end = numel
        pieces.append((first, end))
        first = end
    return pieces


_MOMENTS = (("exp_avg", True), ("exp_avg_sq", False))  # (key, signed map)


# The float64 square root runs this many elements at a time: its temporary copy stays
# at 512 KiB, not 8 bytes per element of the largest tensor (an 8-bit state's saving).
_SQRT_CHUNK = 1 << 16


def _sqrt_rounded(values: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 square root of float32 ``values`` (as the fused
    kernel's), through float64 in chunks of :data:`_SQRT_CHUNK` elements."""
    root = torch.empty_like(values, memory_format=torch.contiguous_format)
    flat_root = root.view(-1)
    for start, chunk in zip(
        range(0, values.numel(), _SQRT_CHUNK),
        values.reshape(-1).split(_SQRT_CHUNK),
        strict=True,
    ):
        flat_root[start : start + chunk.numel()].copy_(chunk.double().sqrt_())
    return root


class CompensatedAdamW8bit(SeededOptimizer):
    """AdamW for bf16 weights with blockwise 8-bit moments (see the module).

    Args:
        params: parameters or parameter groups, as for any torch optimizer.
        lr, betas, eps, weight_decay, maximize: as in ``torch.optim.AdamW``.
        decoupled_weight_decay: True for AdamW's decay, False for Adam's L2 term.
        compensation: ``"stochastic"`` (default: bfloat16 weights round
            stochastically; no buffer) or ``"kahan"`` (a compensation buffer per
            weight, 2 more bytes a parameter).
        seed: seeds the stochastic rounding's random stream.
        fused: ``None`` (default): step each bfloat16 tensor with quantized moments by
            one compiled kernel (:mod:`amped.optim.adamw8bit_fused`) under stochastic
            rounding, where torch.compile can build it, else eagerly, with one warning;
            ``True``: an error instead where it cannot; ``False``: always eager.
        bounded: ``True`` (default): clamp each element of a tensor with quantized
            moments to the largest step exact Adam can take (:func:`step_bound`), so
            that a second moment flushed to zero under a surviving first moment cannot
            step ``lr * m / eps``; ``False``: torchao's ``AdamW8bit`` step unchanged
            (its moments, codes and update), which can diverge on sparse gradients
            (embeddings of rare tokens) where float32 AdamW trains.

    Example:
        >>> import torch, amped
        >>> model = torch.nn.Linear(256, 32).bfloat16()
        >>> opt = amped.optim.adamw8bit.CompensatedAdamW8bit(model.parameters(), lr=1e-4)
        >>> model(torch.randn(3, 256, dtype=torch.bfloat16)).float().sum().backward()
        >>> opt.step()
        >>> opt.state[model.weight]["exp_avg_codes"].dtype, opt.state[model.bias]["exp_avg"].dtype
        (torch.uint8, torch.float32)
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
        compensation: Compensation = "stochastic",
        seed: int = 0,
        fused: bool | None = None,
        bounded: bool = True,
    ) -> None:
        defaults = adamw_defaults(
            lr, betas, eps, weight_decay, decoupled_weight_decay, maximize, compensation
        )
        if not isinstance(bounded, bool):
            raise type_error("bounded must be True or False", "bounded", bounded)
        super().__init__(params, defaults, seed, fused)
        self.bounded = bounded
        self._key: torch.Tensor | None = None  # this step's noise key, drawn on first use
        self._offsets: dict[torch.Tensor, int] = {}

    # -- the step ---------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepped = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        for param in stepped:  # refuse before anything is written
            self._refuse(param, self._group(param))
        for param in stepped:
            self.step_parameter(param)
        self.end_step()
        return loss

    @torch.no_grad()
    def step_parameter(self, param: torch.Tensor) -> None:
        """Step one parameter from its gradient (the step of :meth:`step` for it).

        Call :meth:`end_step` after the last parameter of a step, so that the next
        step draws new random bits.
        """
        group = self._group(param)
        self._refuse(param, group)
        state = self.state[param]
        if "step" not in state:
            self._init_state(param, group, state)
        state["step"] += 1
        count = state["step"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        assert param.grad is not None  # _refuse
        if self._fusable(param, group) and self._step_fused(param, group, state, count):
            return
        grad = local(param.grad).to(torch.float32, copy=True)
        if group["maximize"]:
            grad.neg_()
        weight = local(param.detach()).to(torch.float32, copy=True)
        if wd != 0 and not group["decoupled_weight_decay"]:
            grad = grad + wd * weight
        # Every float32 operation is rounded on its own, as in the fused kernel, so that
        # both steps give the same bits: lerp as ``m + w * (g - m)`` (eager lerp fuses
        # the multiply and add, Inductor's does not: torchao's compiled step rounds as
        # here), and a correctly rounded square root (eager float32 sqrt is off by an
        # ulp on about 0.7% of values; the float64 root rounded to float32 is exact).
        exp_avg = self._moment(param, state, "exp_avg", True)
        exp_avg = exp_avg + (1 - beta1) * (grad - exp_avg)
        exp_avg_sq = self._moment(param, state, "exp_avg_sq", False)
        exp_avg_sq = exp_avg_sq + (1 - beta2) * (grad * grad - exp_avg_sq)
        self._store(param, state, "exp_avg", True, exp_avg)
        self._store(param, state, "exp_avg_sq", False, exp_avg_sq)
        # torch's bias corrections, in Python floats (double precision).
        root = _sqrt_rounded(exp_avg_sq)
        denom = root.div_(math.sqrt(1 - beta2**count)).add_(eps)
        ratio = exp_avg.div_(denom)
        bound = self._bound(state, group, count)
        if bound != math.inf:
            ratio.clamp_(-bound, bound)
        update = ratio.mul_(-lr / (1 - beta1**count))
        if wd != 0 and group["decoupled_weight_decay"]:
            update.add_(weight * (-lr * wd))  # below half an ulp: compensated too
        self._apply(param, group, state, weight, update)

    def _bound(self, state: dict, group: dict, count: int) -> float:
        """The clamp on ``m / (sqrt(v_hat) + eps)``: :func:`step_bound` in float32 for a
        tensor with quantized moments under ``bounded``, else inf (float32 moments are
        exact Adam's and within it)."""
        if not self.bounded or "exp_avg" in state:
            return math.inf
        beta1, beta2 = group["betas"]
        return float(torch.tensor(step_bound(beta1, beta2, count), dtype=torch.float32))

    def _fusable(self, param: torch.Tensor, group: dict) -> bool:
        if self.fused is False or torch.compiler.is_compiling() or python_mode_active():
            return False
        if param.dtype is not torch.bfloat16 or group["compensation"] != "stochastic":
            return False
        if not q8.quantizes(param.numel()) or type(param) not in (torch.Tensor, nn.Parameter):
            return False
        assert param.grad is not None
        if not (param.is_contiguous() and param.grad.is_contiguous()):
            return False
        reason = fused_kernels.available(param.device.type)
        if reason is not None and self.fused:
            raise RuntimeError(
                f"fused=True cannot run here: {reason}. Pass fused=None (the eager step "
                "where the fused one cannot run) or fused=False"
            )
        return reason is None

    def _step_fused(self, param: torch.Tensor, group: dict, state: dict, count: int) -> bool:
        lr, wd = group["lr"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        decoupled = group["decoupled_weight_decay"]
        scalars = [
            -1.0 if group["maximize"] else 1.0,
            0.0 if decoupled else wd,
            1 - beta1,
            1 - beta2,
            math.sqrt(1 - beta2**count),
            group["eps"],
            -lr / (1 - beta1**count),
            -lr * wd if decoupled else 0.0,
            self._bound(state, group, count),
        ]
        device = param.device
        assert param.grad is not None
        flat = (
            param.grad.view(-1),
            param.detach().view(-1),
            state["exp_avg_codes"].view(-1),
            state["exp_avg_sq_codes"].view(-1),
        )
        tables = (
            q8.thresholds(True, device),
            q8.thresholds(False, device),
            torch.tensor(scalars, dtype=torch.float32, device=device),
        )
        start = self._start(param)
        for first, end in _pieces(param.numel()):
            # (blocks, BLOCK) views: the kernel's loops then share one extent (see
            # amped.optim.adamw8bit_fused).
            grad, weight, avg_codes, avg_sq_codes = (t[first:end].view(-1, q8.BLOCK) for t in flat)
            blocks = slice(first // q8.BLOCK, end // q8.BLOCK)
            args = (
                grad,
                weight,
                avg_codes,
                state["exp_avg_scale"][blocks],
                avg_sq_codes,
                state["exp_avg_sq_scale"][blocks],
                *tables,
                start + _int32(first),  # the piece's first element number
            )
            if not adamw8bit_(bool(self.fused), args):
                if first == 0:
                    return False  # nothing written: the eager step takes the parameter
                raise RuntimeError(  # the kernel ran on the first piece: cannot happen
                    "amped's fused 8-bit step failed after its first piece; pass fused=False"
                )
        return True

    def end_step(self) -> None:
        """Close a step made of :meth:`step_parameter` calls: the next one draws new bits."""
        self._key = None

    def moments(self, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``param``'s first and second moments as new float32 tensors of its shape
        (dequantized where they are 8-bit; DTensors sharded like an FSDP2 ``param``).
        Raises KeyError before its first step."""
        state = self.state[param]
        if "step" not in state:
            raise KeyError(f"{type(self).__name__} has no state for this parameter yet")
        moments = (
            self._moment(param, state, "exp_avg", True),
            self._moment(param, state, "exp_avg_sq", False),
        )
        if is_sharded(param):
            return rebuild(param, moments[0], param.shape), rebuild(param, moments[1], param.shape)
        return moments

    def _group(self, param: torch.Tensor) -> dict:
        for group in self.param_groups:
            if any(p is param for p in group["params"]):
                return group
        raise value_error(
            "step_parameter() takes a parameter of this optimizer's groups",
            "param.shape",
            tuple(param.shape),
        )

    def _refuse(self, param: torch.Tensor, group: dict) -> None:
        if param.grad is None:
            raise value_error(
                "step_parameter() needs the parameter's gradient; it has none", "grad", None
            )
        super()._refuse(param, group)

    def _init_state(self, param: torch.Tensor, group: dict, state: dict) -> None:
        state["step"] = 0
        for key, _ in _MOMENTS:
            if q8.quantizes(param.numel()) and is_sharded(param):  # the unsharded size
                sharded_state.init_state(param, state, key)
            elif q8.quantizes(param.numel()):
                blocks = param.numel() // q8.BLOCK
                state[f"{key}_codes"] = torch.zeros(
                    param.shape, dtype=torch.uint8, device=param.device
                )
                state[f"{key}_scale"] = torch.zeros(
                    blocks, dtype=torch.float32, device=param.device
                )
            elif is_sharded(param):
                state[key] = torch.zeros_like(param, dtype=torch.float32)
            else:
                state[key] = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
        if group["compensation"] == "kahan" and param.dtype in _LOW_DTYPES:
            state["compensation"] = torch.zeros_like(param, memory_format=torch.contiguous_format)

    @staticmethod
    def _moment(param: torch.Tensor, state: dict, key: str, signed: bool) -> torch.Tensor:
        """The moment in float32, of ``param``'s local shard if it is a DTensor."""
        if key in state:
            return local(state[key]).clone()
        if is_sharded(param):
            return sharded_state.dequantize(param, state, key, signed)
        return q8.dequantize(state[f"{key}_codes"], state[f"{key}_scale"], signed)

    @staticmethod
    def _store(
        param: torch.Tensor, state: dict, key: str, signed: bool, value: torch.Tensor
    ) -> None:
        if key in state:
            local(state[key]).copy_(value)
            return
        if is_sharded(param):
            sharded_state.store(param, state, key, signed, value)
            return
        codes, scale = q8.quantize(value, signed)
        state[f"{key}_codes"].copy_(codes)
        state[f"{key}_scale"].copy_(scale)

    def _apply(
        self,
        param: torch.Tensor,
        group: dict,
        state: dict,
        weight: torch.Tensor,
        update: torch.Tensor,
    ) -> None:
        """``param += update``: plainly (float32), compensated (Kahan) or stochastically
        rounded; ``weight`` is ``param`` in float32 (consumed)."""
        shard = local(param)
        if shard.dtype not in _LOW_DTYPES:
            shard.add_(update)
        elif group["compensation"] == "kahan":
            kahan_add_(shard, update, local(state["compensation"]))
        else:
            value = weight.add_(update)
            noise = torch.empty(value.shape, dtype=torch.int32, device=value.device)
            counters = torch.arange(value.numel(), dtype=torch.int32, device=value.device)
            scratch = torch.empty_like(noise)
            hashed_noise_(noise.view(-1), counters, self._start(param), scratch.view(-1))
            shard.copy_(rounded_with_noise_(value, noise))

    def _start(self, param: torch.Tensor) -> torch.Tensor:
        """The 0-dim int32 number of ``param``'s first element in this step's noise."""
        if self._key is None:
            self._key = draw_keys(1, self._rng(param.device))[0]
            self._offsets.clear()
            total = 0
            for group in self.param_groups:
                for p in group["params"]:
                    self._offsets[p] = total
                    total += p.numel()
        # An FSDP2 shard's elements by their place in the unsharded parameter.
        offset = _int32((self._offsets[param] + flat_start(param)) % (1 << 32))
        return self._key.to(param.device).add(offset)

    # -- saving and loading -----------------------------------------------------------

    def _loaded(self, state_dict: dict[str, Any]) -> None:
        """After loading, each state tensor takes its saved dtype back (uint8 codes,
        float32 scales and small moments): torch casts them to the parameter's."""
        params = [p for g in self.param_groups for p in g["params"]]
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        for param, saved_id in zip(params, saved_ids, strict=True):
            for key, value in state_dict["state"].get(saved_id, {}).items():
                if isinstance(value, torch.Tensor):
                    self.state[param][key] = value.to(param.device, copy=True)
        self._key = None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_key"] = None
        state["_offsets"] = {}
        return state
