"""How far a GEMM's output may be from the exact product of its operands.

A low-precision GEMM multiplies exactly and accumulates in float32: an FP8 or FP4
element has at most 4 significant bits (8 in a product), a bfloat16 operand 8 (16 in
a product), so every product is exact in float32, and a power-of-two scale
(rowwise, MX, folded into the operand) changes no bit. What is left, for one output
element ``P = sum_k a_k b_k`` over ``K`` products (``u = 2**-24``, float32's unit
roundoff; ``S = sum_k |a_k b_k|``):

1. the float32 sum, in any order: ``|s - P| <= gamma_K * S``,
   ``gamma_K = K u / (1 - K u)`` (Higham, *Accuracy and Stability*, Thm. 3.1);
2. up to two float32 scale factors applied to the sum, each a float32 reciprocal and a
   product: at most four roundings of ``u``;
3. rounding to the output dtype (unit roundoff ``u_o``, ``2**-8`` for bfloat16): at
   most twice (amped's bfloat16 emulation rounds the sum, then the scaled result), once
   more in the forward pass where the bias is added in the output dtype;
4. the output dtype's subnormals: half its smallest subnormal per rounding.

With ``c = (1 + u_o)**r (1 + u)**4 - 1`` for ``r`` output roundings::

    |out - P| <= (1 + c) gamma_K S + c |P| + r * tiny_o + 2**-50 S

The last term covers the float64 reference itself (NVFP4's E4M3 block scale times its
float32 tensor scale, and FP8's unrounded float32 scales, are products and quotients
rounded once in float64). The bound is elementwise and derived, not tuned: a GEMM that
drops a scale, applies one twice, or accumulates in less than float32 exceeds it.
"""

from __future__ import annotations

import torch

__all__ = ["gemm_bound", "unit_roundoff"]

_U32 = 2.0**-24


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half an ulp at 1 (``eps / 2``): bfloat16 ``2**-8``, float32 ``2**-24``."""
    return torch.finfo(dtype).eps / 2


def _tiny(dtype: torch.dtype) -> float:
    """Half the smallest subnormal of ``dtype``."""
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps / 2


def gemm_bound(
    a: torch.Tensor,
    b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact ``a @ b.T (+ bias)`` in float64 and the bound on each output element.

    Args:
        a, b: the GEMM's operands as it multiplied them, float64, ``[M, K]`` and
            ``[N, K]``.
        out_dtype: the GEMM's output dtype.
        bias: added in ``out_dtype`` after the GEMM (the forward pass), or None.
    """
    k = a.shape[1]
    gamma = k * _U32 / (1 - k * _U32)
    u_o = unit_roundoff(out_dtype)
    roundings = 2 if bias is None else 3
    c = (1 + u_o) ** roundings * (1 + _U32) ** 4 - 1
    product = a @ b.t()
    magnitude = a.abs() @ b.abs().t()
    reference = product
    if bias is not None:
        reference = product + bias.to(out_dtype).to(torch.float64)
    bound = (1 + c) * gamma * magnitude + c * product.abs() + 2.0**-50 * magnitude
    if bias is not None:  # the bias is added to the rounded product: |P + b| one more u_o
        bound = bound + u_o * reference.abs()
    return reference, bound + roundings * _tiny(out_dtype)
