"""The fused master-weight step's kernels: torch's Adam(W) and SGD on flat rows, in one pass.

Each kernel takes one chunk of parameters as flat rows (:mod:`amped.optim.master_step`
gathers them): the gradient (low precision, or float32), the float32 master, the
optimizer's float32 state and, for a lowered parameter, the model's low-precision
weight. It reads each value once, unscales the gradient (``fp16-master``), updates
the master and the state in place, and writes the master rounded to nearest into the
low-precision row: what the unfused O2 step does in five passes (gradient to float32,
unscale, ``torch.optim`` step, master to model), each a loop through memory.
Compiled with ``torch.compile(dynamic=True)`` by :func:`amped.optim.fused.run`'s
machinery (C++ with OpenMP on CPUs, Triton on GPUs).

Numerics: each kernel repeats the float32 ops of torch's single-tensor algorithm
(``torch.optim.adam._single_tensor_adam``, ``torch.optim.sgd._single_tensor_sgd``,
which ``torch.optim`` runs on CPU tensors), in order, with the same float32 scalars.
Where torch's eager CPU kernel fuses a multiply and an add into one rounding (``lerp``,
``addcmul``, ``add(alpha=)``), the kernel does too (:func:`fma`); measured: bitwise
for every op but one. That one is Adam's ``sqrt``: eager CPU ``sqrt`` is not correctly
rounded (MKL's vector sqrt, off by one float32 ulp on about 0.7% of elements), the
kernel's is. One ulp of the denominator moves the update by 2**-24 of itself, so a
master differs by at most one float32 ulp of its update per step, and its
low-precision weight only where the master lies that close to a rounding boundary
(``tests/optim/test_recipes_master_fused.py`` holds the two steps to those bounds). SGD has
no such op: it is bitwise.
"""

from __future__ import annotations

import torch

from amped._internal.torch_compat import fma

__all__ = ["adam", "sgd"]


def _gradient(
    grad: torch.Tensor, inv_scale: torch.Tensor, unscale: bool, maximize: bool
) -> torch.Tensor:
    """The float32 gradient: ``grad.float() * inv_scale`` as GradScaler.unscale_ does, negated
    to maximize (exact)."""
    g = grad.to(torch.float32)
    if unscale:
        g = g * inv_scale
    if maximize:
        g = -g
    return g


def adam(
    grad: torch.Tensor,
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    low: torch.Tensor,
    scalars: torch.Tensor,
    unscale: bool,
    maximize: bool,
    l2: bool,
    decoupled: bool,
    write_low: bool,
) -> None:
    """One Adam (``l2``) or AdamW (``decoupled``) step of flat rows, in place.

    ``scalars`` (float32): inverse scale, weight decay, ``1 - lr * weight_decay``, the
    first moment's lerp weight ``1 - beta1``, beta2, ``1 - beta2``, the square root of
    the second bias correction, eps, ``-lr / first bias correction``.
    """
    inv_scale, decay, keep, weight1 = scalars[0], scalars[1], scalars[2], scalars[3]
    beta2, weight2, correction2, eps, step_size = (scalars[i] for i in range(4, 9))
    g = _gradient(grad, inv_scale, unscale, maximize)
    p = master
    if decoupled:
        p = p * keep  # param.mul_(1 - lr * weight_decay)
    if l2:
        g = fma(p, decay, g)  # grad.add(param, alpha=weight_decay)
    m = exp_avg
    # exp_avg.lerp_(grad, weight): torch's vector lerp is fmadd(coeff, end - start, base)
    small = weight1.abs() < 0.5
    coeff = torch.where(small, weight1, weight1 - 1)
    m = fma(coeff, g - m, torch.where(small, m, g))
    v = fma(g * weight2, g, exp_avg_sq * beta2)  # mul_(beta2).addcmul_(g, g, value=1-beta2)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    denom = v.sqrt() / correction2 + eps  # (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
    p = p + step_size * m / denom  # param.addcdiv_(exp_avg, denom, value=-step_size)
    master.copy_(p)
    if write_low:
        low.copy_(p.to(low.dtype))  # param.copy_(master): to nearest, once


def sgd(
    grad: torch.Tensor,
    master: torch.Tensor,
    buffer: torch.Tensor,
    low: torch.Tensor,
    scalars: torch.Tensor,
    unscale: bool,
    maximize: bool,
    l2: bool,
    momentum: bool,
    first: bool,
    nesterov: bool,
    write_low: bool,
) -> None:
    """One SGD step of flat rows, in place; ``first``: the momentum buffer starts as the
    gradient (torch's first step), else it is read.

    ``scalars`` (float32): inverse scale, weight decay, momentum, ``1 - dampening``, -lr.
    """
    inv_scale, decay, beta, undamped, neg_lr = (scalars[i] for i in range(5))
    g = _gradient(grad, inv_scale, unscale, maximize)
    p = master
    if l2:
        g = fma(p, decay, g)  # grad.add(param, alpha=weight_decay)
    if momentum:
        # buf = grad.detach().clone() at the first step, else buf.mul_(m).add_(g, alpha=1-d)
        velocity = g if first else fma(g, undamped, buffer * beta)
        buffer.copy_(velocity)
        g = fma(velocity, beta, g) if nesterov else velocity  # grad.add(buf, alpha=m)
    p = fma(g, neg_lr, p)  # param.add_(grad, alpha=-lr)
    master.copy_(p)
    if write_low:
        low.copy_(p.to(low.dtype))
