"""The random Hadamard transform (RHT) of NVIDIA's NVFP4 recipe, 16x16 blocks.

Block-scaled FP4 loses the small entries of a block that holds an outlier. Rotating the
inner dim of a GEMM's operands by an orthogonal matrix ``R`` spreads an outlier over
its block before the cast, and leaves the product unchanged in exact arithmetic::

    a @ b = (a @ R) @ (R.T @ b)         because R @ R.T = I

Here ``R`` is block diagonal, one ``16 x 16`` block ``diag(signs) @ H / 4`` per 16
rows, ``H`` the Sylvester Hadamard matrix (entries +-1) and ``signs`` a random +-1
vector fixed per layer by its seed. The recipe applies it to the weight-gradient
GEMM, whose inner dim is the tokens: ``grad_weight = grad_output.T @ input``.
"""

from __future__ import annotations

import torch

from amped._internal.errors import value_error

__all__ = ["HADAMARD_SIZE", "hadamard_matrix", "random_hadamard", "rotate_rows"]

HADAMARD_SIZE = 16


def hadamard_matrix(n: int = HADAMARD_SIZE) -> torch.Tensor:
    """The ``n x n`` Sylvester Hadamard matrix divided by ``sqrt(n)`` (orthogonal), float32."""
    if n < 1 or n & (n - 1):
        raise value_error("Sylvester Hadamard matrices have a power-of-two size", "n", n)
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5


def random_hadamard(seed: int, n: int = HADAMARD_SIZE) -> torch.Tensor:
    """``diag(signs) @ hadamard_matrix(n)``, the signs drawn from ``seed`` (float32)."""
    generator = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (n,), generator=generator).to(torch.float32) * 2 - 1
    return signs.unsqueeze(1) * hadamard_matrix(n)


def rotate_rows(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """``R.T @ x`` for ``R`` block diagonal with ``rotation`` blocks: each 16 rows of the
    2-D ``x`` (rows a multiple of 16) mixed by ``rotation.T``, in float32 (float64 for
    a float64 ``x``)."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    n = rotation.shape[0]
    blocks = x.to(dtype).unflatten(0, (-1, n))  # [rows / n, n, cols]
    return torch.matmul(rotation.t().to(x.device, dtype), blocks).flatten(0, 1)
