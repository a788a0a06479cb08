"""Shared pieces of the attention tests: a run of forward and backward, torch's SDPA math
backend as the oracle, and the float32 reassociation bound between two attentions.

**The bound.** Two float32 attentions that compute the same function in different orders
(amped's tiles and ``(Q·Kᵀ)·scale``, torch's ``(Q·√scale)·(K·√scale)ᵀ`` on the whole
matrix, softmax as ``exp(S - m) / Σ`` or ``exp(S - lse)``) each sit within a rounding
bound of the exact result, so they differ by at most the sum of the two. With
``u = 2**-24`` and ``γ(n) = n·u / (1 - n·u)`` (a sum of ``n`` terms in any order is within
``γ(n)·Σ|terms|``, Higham, *Accuracy and Stability of Numerical Algorithms* §3.1), per
implementation:

- ``S``: ``eS = γ(D + 2)·scale·(|Q|·|K|ᵀ)`` (D products, two scalings);
- ``P`` relative: ``δP = 2·max_k eS + γ(Tk) + 4u + 3u·⌈Tk/32⌉`` (its own S error, the
  log-sum-exp's, which averages the row's S errors and sums Tk terms, exp/log/division
  roundings, and amped's online softmax: its running sum is rescaled by
  ``exp(m_old - m_new)`` at most once per key tile of at least 32 keys, each an exp, a
  subtraction and a product of at most 1u);
- ``O``: ``(γ(Tk) + δP)·(P·|V|)``; ``dV``: ``(γ(Tq) + δP)·(Pᵀ·|dO|)``;
- ``dP``: ``eP = γ(D)·(|dO|·|V|ᵀ)``; the row sum ``Δ = Σ P·dP``:
  ``eΔ = (γ(Tk) + δP)·Σ P·|dP| + Σ P·eP``;
- ``dS``: ``edS = P·(eP + eΔ + δP·|dP - Δ|)``;
- ``dQ``: ``scale·((γ(Tk) + 4u)·(|dS|·|K|) + edS·|K|)``; ``dK`` likewise over Tq with Q.

Twice each (two implementations), computed in float64 from the reference's own P and
dP. Where an output is rounded to bfloat16, both roundings add one bfloat16 ulp of the
value. Under GQA the group's per-head gradients add up: their bounds add, plus
``γ(group)`` of their magnitudes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

U = 2.0**-24


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def run(fn, q, k, v, grad_out=None, **kwargs):
    """``fn(q, k, v, **kwargs)`` forward and backward: (out, dq, dk, dv)."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v, **kwargs)
    if grad_out is None:
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    out.backward(grad_out.to(out.dtype))
    return out.detach(), q.grad, k.grad, v.grad


def sdpa_math(q, k, v, grad_out=None, **kwargs):
    with sdpa_kernel(SDPBackend.MATH):
        return run(F.scaled_dot_product_attention, q, k, v, grad_out, **kwargs)


def _expand(x, heads):
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def _probs(q, k, mask, is_causal, scale):
    s = scale * (q @ k.mT)
    tq, tk = s.shape[-2:]
    if is_causal:
        s = s.masked_fill(~torch.ones(tq, tk, dtype=torch.bool).tril(), -math.inf)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask.double()
    p = torch.softmax(s, dim=-1)
    return torch.nan_to_num(p, nan=0.0)  # a row that sees nothing: 0


def reassociation_bound(q, k, v, grad_out, attn_mask=None, is_causal=False, bf16_refs=None):
    """The elementwise bounds on |amped - torch| for (out, dq, dk, dv) (module doc);
    ``bf16_refs``: torch's results, where they are rounded to bfloat16."""
    q, k, v, do = (x.detach().double() for x in (q, k, v, grad_out))
    h, d = q.shape[1], q.shape[-1]
    ke, ve = _expand(k, h), _expand(v, h)
    scale = 1 / math.sqrt(d)
    tq, tk = q.shape[-2], k.shape[-2]
    p = _probs(q, ke, attn_mask, is_causal, scale)
    seen = p > 0
    e_s = gamma(d + 2) * scale * (q.abs() @ ke.abs().mT)
    rescales = 3 * U * math.ceil(tk / 32)  # amped's online softmax, one per key tile
    d_p = 2 * torch.where(seen, e_s, 0).amax(-1, keepdim=True) + gamma(tk) + 4 * U + rescales
    out = (gamma(tk) + d_p) * (p @ ve.abs())
    dv = (gamma(tq) + d_p.amax()) * (p.mT @ do.abs())
    dp = do @ ve.mT
    e_p = gamma(d) * (do.abs() @ ve.abs().mT)
    delta = (p * dp).sum(-1, keepdim=True)
    e_delta = (gamma(tk) + d_p) * (p * dp.abs()).sum(-1, keepdim=True) + (p * e_p).sum(
        -1, keepdim=True
    )
    ds = p * (dp - delta)
    e_ds = p * (e_p + e_delta + d_p * (dp - delta).abs())
    dq = scale * ((gamma(tk) + 4 * U) * (ds.abs() @ ke.abs()) + e_ds @ ke.abs())
    dk = scale * ((gamma(tq) + 4 * U) * (ds.abs().mT @ q.abs()) + e_ds.mT @ q.abs())
    dk, dv = (_group(g, k.shape[1], mag) for g, mag in ((dk, ds.abs().mT @ q.abs()), (dv, None)))
    bounds = [2 * b for b in (out, dq, dk, dv)]
    if bf16_refs is not None:
        bounds = [b + _bf16_ulp(r) for b, r in zip(bounds, bf16_refs, strict=True)]
    return bounds


def _group(bound, kv_heads, magnitude):
    """A per-Q-head gradient bound summed over each K/V head's group."""
    if bound.shape[1] == kv_heads:
        return bound
    group = bound.shape[1] // kv_heads
    summed = bound.unflatten(1, (kv_heads, group)).sum(2)
    return summed + gamma(group) * summed  # the group sum's own rounding, loosely


def _bf16_ulp(x):
    mag = x.detach().double().abs().clamp(min=2.0**-126)
    return torch.exp2(torch.floor(torch.log2(mag)) - 7)


def assert_within(actual, expected, bound, what):
    diff = (actual.double() - expected.double()).abs()
    excess = diff - bound
    worst = int(excess.flatten().argmax())
    assert bool((excess <= 0).all()), (
        f"{what}: |amped - torch| exceeds the reassociation bound at flat index {worst}: "
        f"diff {diff.flatten()[worst]:.3g}, bound {bound.flatten()[worst]:.3g}"
    )
