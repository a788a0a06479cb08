"""The random Hadamard transform (RHT) of NVIDIA's NVFP4 recipe, 16x16 blocks.

Block-scaled FP4 loses the small entries of a block that holds an outlier. Rotating the
inner dim of a GEMM's operands by an orthogonal matrix ``R`` spreads an outlier over
its block before the cast, and leaves the product unchanged in exact arithmetic::

    a @ b = (a @ R) @ (R.T @ b)         because R @ R.T = I

Here ``R`` is block diagonal, one ``16 x 16`` block ``diag(signs) @ H / 4`` per 16
rows, ``H`` the Sylvester Hadamard matrix (entries +-1) and ``signs`` a random +-1
vector fixed per layer by its seed. The recipe applies it to the weight-gradient
GEMM, whose inner dim is the tokens: ``grad_weight = grad_output.T @ input``.

The layers rotate inside their cast kernel (:mod:`.block_kernel`) with
:func:`hadamard_rows`: ``R.T @ x = H @ (signs * x) / 4`` as a butterfly of four stages of
float32 additions and subtractions (no matrix product, no float32 copy of the operand).
Every step is one rounding of exact operands (a sign flip and the final ``/ 4`` are
exact), so eager and compiled code give the same bits; the matrix form
:func:`rotate_rows` sums in another order and can differ from it in the last bit.
"""

from __future__ import annotations

import torch

from amped._internal.errors import value_error

__all__ = [
    "HADAMARD_SIZE",
    "hadamard_matrix",
    "hadamard_rows",
    "hadamard_signs",
    "random_hadamard",
    "rotate_rows",
]

HADAMARD_SIZE = 16


def hadamard_matrix(n: int = HADAMARD_SIZE) -> torch.Tensor:
    """The ``n x n`` Sylvester Hadamard matrix divided by ``sqrt(n)`` (orthogonal), float32."""
    if n < 1 or n & (n - 1):
        raise value_error("Sylvester Hadamard matrices have a power-of-two size", "n", n)
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5


def hadamard_signs(seed: int, n: int = HADAMARD_SIZE) -> torch.Tensor:
    """The random +-1 signs (float32, ``n``) of :func:`random_hadamard` for ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (n,), generator=generator).to(torch.float32) * 2 - 1


def random_hadamard(seed: int, n: int = HADAMARD_SIZE) -> torch.Tensor:
    """``diag(signs) @ hadamard_matrix(n)``, the signs drawn from ``seed`` (float32)."""
    return hadamard_signs(seed, n).unsqueeze(1) * hadamard_matrix(n)


def hadamard_rows(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``R.T @ x`` for ``R`` block diagonal with ``diag(signs) @ hadamard_matrix(16)``
    blocks (:func:`random_hadamard`), as a butterfly: ``x`` float32 (or float64), 2-D,
    rows a multiple of 16; ``signs`` 16 values +-1 in ``x``'s dtype.

    ``H`` is the Kronecker product of four ``[[1, 1], [1, -1]]``: each stage takes the
    pairs of rows whose index differs in one bit and makes ``a + b`` and ``a - b``
    (written as ``a + (+-1) * b``, a broadcast with no concatenation, which a compiler
    fuses into one loop; the product by +-1 is exact, so a fused multiply-add rounds as
    the addition does).
    """
    n = HADAMARD_SIZE
    y = x.unflatten(0, (-1, n)) * signs.view(n, 1)
    y = y.unflatten(1, (2, 2, 2, 2))  # [blocks, 2, 2, 2, 2, cols]: the row index's bits
    plus_minus = torch.tensor([1.0, -1.0], dtype=x.dtype, device=x.device)
    for axis in range(1, 5):
        a, b = y.narrow(axis, 0, 1), y.narrow(axis, 1, 1)
        shape = [1] * y.dim()
        shape[axis] = 2
        y = a + plus_minus.view(shape) * b
    return (y * (1 / n**0.5)).reshape(x.shape)


def rotate_rows(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """``R.T @ x`` for ``R`` block diagonal with ``rotation`` blocks: each 16 rows of the
    2-D ``x`` (rows a multiple of 16) mixed by ``rotation.T``, in float32 (float64 for
    a float64 ``x``)."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    n = rotation.shape[0]
    blocks = x.to(dtype).unflatten(0, (-1, n))  # [rows / n, n, cols]
    return torch.matmul(rotation.t().to(x.device, dtype), blocks).flatten(0, 1)
