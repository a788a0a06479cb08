"""The compensated optimizers' fused step: a chunk's whole update in one compiled kernel.

The eager step (:mod:`amped.optim.compensated`) runs each stage of the algorithm as
one torch op over a chunk's float32 work rows: about 35 passes over memory for
AdamW, each a separate loop. Here the same algorithm, op for op, is one function of
flat low-precision rows (gradient, weight and state, gathered from the chunk's
parameters), compiled once per process with ``torch.compile(dynamic=True)`` (C++ with
OpenMP on CPUs, Triton on GPUs): it reads every low-precision value once, keeps the
float32 intermediates in registers and writes the results once. The random bits of
stochastic rounding are :mod:`amped.optim.noise`'s, computed inside the kernel from
the element numbers.

Numerics: the kernels run the eager step's float32 ops in the same order. The one
rounding whose result is used again, the Kahan step's weight, is made in float32
arithmetic (:func:`_split`), not by a cast round trip, which compilers may drop. Three
kinds of float32 rounding differ from torch's eager CPU kernels, each
by at most one float32 ulp of the intermediate: eager ``lerp``, ``add(alpha=)`` and
``addcmul`` fuse their multiply and add into one rounding (FMA), which Inductor's C++
code does not (emulating it in float64 made the kernel seven times slower); and
eager ``sqrt`` is SLEEF's, within 0.5001 ulp, where the kernel's is correctly
rounded (they differ on about 0.6% of elements). Rounded to bfloat16, a one-ulp
float32 difference rarely changes the stored value (about one element in 2**16 per
op), and under Kahan compensation weight plus compensation agrees to about 2**-16 of
the weight: the bounds ``tests/optim/test_recipes_fused.py`` holds the two steps to. The
random bits are the same, so stochastic rounding draws alike.

What is fused: the bfloat16 parameters of a step in which, per parameter group, they
share a step count (AdamW) or all have a momentum buffer already (SGD with momentum).
Other steps (a parameter that missed steps, SGD without momentum, SGD's first step)
are eager, and so are float32 parameters (a plain update), float16 ones (float16's
narrow exponent range would need another split, with subnormals; it is rare in
bf16-pure) and one-element chunks (torch.compile would specialize the kernel for size
1 and compile it again).
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["adamw_", "available", "disable", "sgd_"]

_HIGH_MASK = -(1 << 16)  # 0xFFFF0000 as an int32
_SPLITTER = float(2**16 + 1)  # Veltkamp's constant for 24 -> 8 significant bits
_SPLIT_LIMIT = 2.0**112  # below it, _SPLITTER * x cannot overflow float32
_M1 = 0x7FEB352D  # amped.optim.noise's lowbias32 constants
_M2 = 0x846CA68B - (1 << 32)

_compiled: dict[tuple[str, tuple[bool, ...]], Callable[..., None]] = {}
_broken: dict[str, str] = {}  # device type -> why compiling failed there


def available(device_type: str) -> str | None:
    """None if the fused step may be tried on ``device_type``, else why not."""
    if device_type not in ("cpu", "cuda"):
        return f"torch.compile's fused kernels are used on cpu and cuda only, not {device_type}"
    return _broken.get(device_type)


def disable(device_type: str, reason: str) -> None:
    """Stop trying the fused step on ``device_type`` in this process (a compile failed)."""
    _broken[device_type] = reason


def _kernel(
    function: Callable[..., None], flags: tuple[bool, ...], options: dict[str, Any] | None = None
) -> Callable[..., None]:
    """``function`` compiled for one setting of its trailing boolean ``flags``.

    Each setting compiles a copy of ``function`` with a code object of its own: Dynamo
    keeps its graphs, and counts recompilations against its limit of 8, per code
    object, and a test suite (or a program with several optimizers) uses many
    settings. Within one, only new dtypes and device types compile again.
    """
    key = (function.__name__, flags)
    compiled = _compiled.get(key)
    if compiled is None:
        name = f"{function.__name__}_{''.join('1' if flag else '0' for flag in flags)}"
        code = function.__code__.replace(co_name=name)  # (co_qualname, 3.11+, is left)
        variant = types.FunctionType(code, function.__globals__, name, function.__defaults__)
        compiled = torch.compile(variant, dynamic=True, fullgraph=True, options=options)
        _compiled[key] = compiled
    return compiled


def run(
    function: Callable[..., None],
    device_type: str,
    strict: bool,
    args: tuple[Any, ...],
    flags: tuple[bool, ...],
    who: str = "amped's compensated optimizers",
    options: dict[str, Any] | None = None,
) -> bool:
    """Call ``function(*args, *flags)`` compiled (with Inductor ``options``, the same for
    every call of ``function``); False if it cannot be compiled here.

    With ``strict`` (``fused=True``) a failure raises; otherwise it is reported once,
    as a warning, and the process keeps the eager step on that device type.
    """
    if device_type in _broken:  # a chunk before this one failed to compile
        return False
    try:
        _kernel(function, flags, options)(*args, *flags)
    except Exception as error:
        reason = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"
        if strict:
            raise RuntimeError(
                "fused=True needs torch.compile to build the optimizer's kernel on "
                f"{device_type} (a C++ compiler on CPUs, Triton on GPUs), and it failed: "
                f"{reason}. Pass fused=False for the eager step, or fused=None to fall "
                "back to it automatically"
            ) from error
        disable(device_type, reason)
        warnings.warn(
            f"{who} could not compile their fused step on "
            f"{device_type} ({reason}); they use the eager step, which gives the same "
            "results more slowly. Pass fused=False to skip the attempt",
            RuntimeWarning,
            stacklevel=4,
        )
        return False
    return True


# --- the kernels: pure functions of flat rows, compiled by _kernel ---------------------
# Each repeats an eager op's roundings; the comment names the op.


def _noise(numel: int, start: torch.Tensor, device: torch.device) -> torch.Tensor:
    """:func:`amped.optim.noise.hashed_noise_` of element numbers ``0..numel``."""
    x = torch.arange(numel, dtype=torch.int32, device=device) + start
    x = (x ^ ((x >> 16) & 0xFFFF)) * _M1
    x = (x ^ ((x >> 15) & 0x1FFFF)) * _M2
    return (x >> 16) & 0xFFFF


def _canonical(value: torch.Tensor) -> torch.Tensor:
    """NaNs made the default NaN, as :func:`amped.optim.rounding.rounded_with_noise_`
    does to the row it rounds (``value != value``: Inductor vectorizes it, not isnan)."""
    return torch.where(value != value, float("nan"), value)


def _stochastic(value: torch.Tensor, dtype: torch.dtype, noise: torch.Tensor) -> torch.Tensor:
    """Canonical ``value`` rounded stochastically to ``dtype`` with ``noise``."""
    return ((value.view(torch.int32) + noise) & _HIGH_MASK).view(torch.float32).to(dtype)


def _store(buffer: torch.Tensor, value: torch.Tensor, start: torch.Tensor | None) -> torch.Tensor:
    """Write float32 running average ``value`` into ``buffer``: stochastically with the
    bits numbered from ``start`` if given, else to nearest. Returns the value the step
    goes on with (canonical NaNs after stochastic rounding, as in the eager step)."""
    if start is None:
        buffer.copy_(value.to(buffer.dtype))
        return value
    value = _canonical(value)
    buffer.copy_(_stochastic(value, buffer.dtype, _noise(value.shape[0], start, value.device)))
    return value


def _write(
    target: torch.Tensor,
    compensation: torch.Tensor,
    weight: torch.Tensor,
    update: torch.Tensor,
    noise: torch.Tensor | None,
) -> None:
    """``target = weight + update``, Kahan-compensated, or stochastically rounded."""
    if noise is not None:
        target.copy_(_stochastic(_canonical(update + weight), target.dtype, noise))
        return
    total = weight + (update + compensation.to(torch.float32))
    rounded, lost = _split(total)
    target.copy_(rounded.to(target.dtype))  # exact: a bfloat16 value already
    compensation.copy_(lost.to(compensation.dtype))


def _split(total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``total`` rounded to bfloat16's 8 significant bits, and what that lost (exactly).

    Veltkamp's splitting, in float32 arithmetic alone: ``C * x - (C * x - x)`` with
    ``C = 2**16 + 1`` is ``x`` rounded to nearest at 8 bits, and ``x - hi`` is exact.
    Not ``x.to(bfloat16).to(float32)``: a compiler may (and Inductor in torch 2.11 does)
    drop that round trip as a no-op, which would silently zero the compensation. The
    rounding breaks exact ties (one value in 2**16) possibly away from even where a cast
    would not, which moves a weight by one ulp and its compensation by the same, so
    their sum is unchanged. Values too large for ``C * x`` (beyond 2**112, and infinities)
    are rounded by the cast, with nothing to compensate.
    """
    scaled = total * _SPLITTER
    hi = scaled - (scaled - total)
    large = total.abs() >= _SPLIT_LIMIT  # False for NaN: hi is NaN there anyway
    hi = torch.where(large, total.to(torch.bfloat16).to(torch.float32), hi)
    lost = torch.where(large, 0.0, total - hi)
    return hi, lost


def _plus(value: torch.Tensor, weight: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``value + weight * factor``, or ``value`` itself where ``factor`` is 0, as the eager
    step skips a zero decay: ``inf * 0`` is NaN, and a weight at +-inf must stay there."""
    return torch.where(factor == 0, value, value + weight * factor)


def _adamw(
    grad: torch.Tensor,
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    compensation: torch.Tensor,
    scalars: torch.Tensor,
    starts: torch.Tensor,
    kahan: bool,
    stochastic_avg: bool,
    stochastic_avg_sq: bool,
) -> None:
    """One AdamW step of flat rows, in place (CompensatedAdamW._step_chunk's ops).

    ``scalars`` (float32): sign (-1 to maximize), L2 decay, 1 - beta1, beta2,
    1 - beta2, sqrt of the second bias correction, eps, -lr / first bias correction,
    -lr * decoupled decay. ``starts`` (int32): each write's first random number.
    """
    numel, device = grad.shape[0], grad.device
    sign, l2, weight1, beta2, weight2 = scalars[0], scalars[1], scalars[2], scalars[3], scalars[4]
    correction2, eps, step_size, decay = scalars[5], scalars[6], scalars[7], scalars[8]
    g = grad.to(torch.float32) * sign  # neg_() when maximizing: exact
    w = param.to(torch.float32)
    g = _plus(g, w, l2)  # grad.add_(weight, alpha=wd), only with L2
    m = exp_avg.to(torch.float32).lerp(g, weight1)
    v = exp_avg_sq.to(torch.float32) * beta2 + weight2 * g * g  # mul_, addcmul_
    m = _store(exp_avg, m, starts[0] if stochastic_avg else None)
    v = _store(exp_avg_sq, v, starts[1] if stochastic_avg_sq else None)
    denom = v.sqrt() / correction2 + eps  # sqrt_, div_, add_
    update = m / denom * step_size  # div_, mul_
    update = _plus(update, w, decay)  # update.add_(weight, alpha=-lr * wd), if decoupled
    noise_param = None if kahan else _noise(numel, starts[2], device)
    _write(param, compensation, w, update, noise_param)


def _sgd(
    grad: torch.Tensor,
    param: torch.Tensor,
    buffer: torch.Tensor,
    compensation: torch.Tensor,
    scalars: torch.Tensor,
    starts: torch.Tensor,
    kahan: bool,
    stochastic_buffer: bool,
    nesterov: bool,
) -> None:
    """One SGD-with-momentum step of flat rows whose buffers exist, in place
    (CompensatedSGD._step_chunk's ops).

    ``scalars`` (float32): sign, weight decay, momentum, 1 - dampening, -lr.
    """
    numel, device = grad.shape[0], grad.device
    sign, decay, momentum, undamped, step_size = (scalars[i] for i in range(5))
    g = grad.to(torch.float32) * sign
    w = param.to(torch.float32)
    g = _plus(g, w, decay)  # grad.add_(weight, alpha=weight_decay), only with decay
    velocity = buffer.to(torch.float32) * momentum + g * undamped  # mul_, add_(alpha=)
    velocity = _store(buffer, velocity, starts[0] if stochastic_buffer else None)
    if nesterov:
        velocity = g + velocity * momentum  # grad.add_(velocity, alpha=momentum)
    update = velocity * step_size  # torch.mul(velocity, -lr)
    noise_param = None if kahan else _noise(numel, starts[1], device)
    _write(param, compensation, w, update, noise_param)


def adamw_(device_type: str, strict: bool, args: tuple[Any, ...], flags: tuple[bool, ...]) -> bool:
    """Run :func:`_adamw` compiled; False if it cannot be compiled (see :func:`run`)."""
    return run(_adamw, device_type, strict, args, flags)


def sgd_(device_type: str, strict: bool, args: tuple[Any, ...], flags: tuple[bool, ...]) -> bool:
    """Run :func:`_sgd` compiled; False if it cannot be compiled (see :func:`run`)."""
    return run(_sgd, device_type, strict, args, flags)
