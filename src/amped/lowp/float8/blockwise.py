"""Blockwise FP8 casts: one float32 scale per tile of a 2-D tensor (DeepSeek-V3's recipe).

DeepSeek-V3 and Transformer Engine's ``Float8BlockScaling`` cast every GEMM operand to
E4M3 with one scale per tile: activations and gradients in ``1 x 128`` tiles (one
scale per row per 128 columns), weights in ``128 x 128`` tiles; the grad-weight GEMM,
which contracts over tokens, takes its operands in ``128 x 1`` tiles. Each tile is
cast as a tensorwise cast of that tile (:mod:`amped.lowp.float8.cast`)::

    scale     = float32(fp8_max / max(float64(amax of the tile), 1e-12))
    scale     = 2 ** floor(log2(scale))          # only with power_of_2=True
    data      = to_fp8(clamp(x * scale, -fp8_max, fp8_max))   (x * scale in float32)
    scale_inv = float32(1 / scale)               # what is stored; x ~= data * scale_inv

which is torchao's ``torch_blockwise_scale_act_quant_lhs``/``_rhs`` and
``torch_blockwise_scale_weight_quant`` (``torchao.prototype.blockwise_fp8_training``)
bit for bit, data and ``scale_inv`` (tests/lowp/float8/test_fp8_blockwise.py).
DeepSeek-V3's checkpoints store a weight so: ``weight`` (E4M3) and
``weight_scale_inv`` (float32, one per 128 x 128 tile); :func:`quantize_weight_blockwise`
writes exactly that pair.

**Ragged edges.** A dim that is not a multiple of the tile ends in a partial tile,
scaled by its own amax: what casting the tensor zero-padded to whole tiles and cropping
gives (zeros change no amax), and the layout DeepSeek's ``weight_scale_inv`` has for
such dims (``ceil(rows / 128) x ceil(cols / 128)``). torchao's reference functions
refuse such shapes; the tests compare against them on the padded tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from amped._internal.errors import value_error
from amped.lowp.float8.cast import check_fp8_dtype
from amped.lowp.float8.fp8_kernel import saturated, scale_of

__all__ = [
    "ACTIVATION_TILE",
    "BLOCK",
    "COLUMN_TILE",
    "WEIGHT_TILE",
    "BlockwiseTensor",
    "dequantize_blockwise",
    "quantize_blockwise",
    "quantize_weight_blockwise",
]

BLOCK = 128
"""The tile length of DeepSeek-V3's recipe, and the only one torchao's kernels take."""

ACTIVATION_TILE = (1, BLOCK)
"""Inputs and grad_outputs as the left operand: one scale per row per 128 columns."""
COLUMN_TILE = (BLOCK, 1)
"""Operands of the grad-weight GEMM (contracting over rows): 128 rows of one column."""
WEIGHT_TILE = (BLOCK, BLOCK)
"""Weights: one scale per 128 x 128 tile, the same tiles in the forward and the
grad-input GEMM (the weight's transpose has the transposed tiles)."""

E4M3 = torch.float8_e4m3fn


@dataclass(frozen=True)
class BlockwiseTensor:
    """FP8 ``data`` with one float32 ``scale_inv`` per ``tile`` (``x ~= data * scale_inv``).

    Attributes:
        data: the FP8 tensor, of the shape of the tensor cast.
        scale_inv: float32, ``[ceil(rows / tile[0]), ceil(cols / tile[1])]``: the
            reciprocal of each tile's scale (DeepSeek's ``weight_scale_inv``).
        tile: ``(rows, cols)`` of a tile.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    tile: tuple[int, int]

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def scale_inv_per_element(self) -> torch.Tensor:
        """``scale_inv`` repeated over each tile: float32 of ``data``'s shape."""
        return expand_tiles(self.scale_inv, self.tile, self.data.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data * scale_inv`` in ``dtype`` (the product in float32)."""
        return dequantize_blockwise(self.data, self.scale_inv, self.tile).to(dtype)

    def t(self) -> BlockwiseTensor:
        """The transpose (data, scales and tile together)."""
        tile = (self.tile[1], self.tile[0])
        return BlockwiseTensor(self.data.t(), self.scale_inv.t(), tile)


def expand_tiles(
    per_tile: torch.Tensor, tile: tuple[int, int], shape: tuple[int, ...] | torch.Size
) -> torch.Tensor:
    """A ``[ceil(rows / tile[0]), ceil(cols / tile[1])]`` tensor repeated over each tile
    and cropped to ``shape``."""
    rows, cols = shape
    full = per_tile.repeat_interleave(tile[0], dim=0).repeat_interleave(tile[1], dim=1)
    return full[:rows, :cols]


def _check(x: torch.Tensor, tile: tuple[int, int], dtype: torch.dtype) -> None:
    check_fp8_dtype(dtype)
    if x.dim() != 2:
        raise value_error(
            "A blockwise FP8 cast takes a 2-D tensor (reshape activations to "
            "[tokens, features] first)",
            "x.shape",
            tuple(x.shape),
        )
    if not x.is_floating_point():
        raise value_error("A blockwise FP8 cast takes a floating tensor", "x.dtype", x.dtype)
    valid = len(tile) == 2 and all(isinstance(n, int) and n >= 1 for n in tile)
    if not valid:
        raise value_error(
            "tile is (rows, cols) of positive ints, e.g. (1, 128) for activations, "
            "(128, 128) for weights, (128, 1) for the grad-weight GEMM's operands",
            "tile",
            tile,
        )


@torch.no_grad()
def quantize_blockwise(
    x: torch.Tensor,
    tile: tuple[int, int] = ACTIVATION_TILE,
    *,
    dtype: torch.dtype = E4M3,
    power_of_2: bool = False,
) -> BlockwiseTensor:
    """Cast a 2-D ``x`` to FP8 with one scale per ``tile`` (see the module).

    Args:
        x: a 2-D floating tensor (any dims: a last partial tile is scaled by its own amax).
        tile: ``(rows, cols)``: :data:`ACTIVATION_TILE` ``(1, 128)``,
            :data:`WEIGHT_TILE` ``(128, 128)`` or :data:`COLUMN_TILE` ``(128, 1)``.
        dtype: ``torch.float8_e4m3fn`` (the recipe's) or ``torch.float8_e5m2``.
        power_of_2: round each scale down to a power of two (Transformer Engine's
            ``power_2_scale``; ``data * scale_inv`` is then exact).

    Raises:
        ValueError: ``x`` is not 2-D and floating, ``tile`` is not two positive ints, or
            ``dtype`` is not an FP8 dtype.

    Example:
        >>> import torch
        >>> q = quantize_blockwise(torch.tensor([[0.5, -3.0]]), (1, 128), power_of_2=True)
        >>> q.scale_inv, q.dequantize()
        (tensor([[0.0078]]), tensor([[ 0.5000, -3.0000]]))
    """
    _check(x, tile, dtype)
    rows, cols = x.shape
    th, tw = tile
    padded = F.pad(x, (0, -cols % tw, 0, -rows % th))
    tiles = padded.reshape(padded.shape[0] // th, th, padded.shape[1] // tw, tw)
    amax = tiles.abs().amax(dim=(1, 3))  # exact in x's dtype
    scale = scale_of(amax, dtype, power_of_2)
    data = saturated(tiles, scale[:, None, :, None], dtype).to(dtype)
    data = data.reshape(padded.shape)[:rows, :cols]
    # torchao returns 1.0 / scale, a float32 division: one rounding, the same on every device.
    return BlockwiseTensor(data.contiguous(), 1.0 / scale, (th, tw))


def quantize_weight_blockwise(weight: torch.Tensor, power_of_2: bool = False) -> BlockwiseTensor:
    """A weight ``[out_features, in_features]`` in E4M3 with one scale per 128 x 128 tile:
    the cast every ``fp8-blockwise`` GEMM takes the weight by, and DeepSeek-V3's checkpoint
    layout (``weight`` = ``.data``, ``weight_scale_inv`` = ``.scale_inv``).

    Example:
        >>> import torch
        >>> q = quantize_weight_blockwise(torch.ones(256, 200))
        >>> q.data.dtype, q.scale_inv.shape
        (torch.float8_e4m3fn, torch.Size([2, 2]))
    """
    return quantize_blockwise(weight, WEIGHT_TILE, dtype=E4M3, power_of_2=power_of_2)


def dequantize_blockwise(
    data: torch.Tensor, scale_inv: torch.Tensor, tile: tuple[int, int] = WEIGHT_TILE
) -> torch.Tensor:
    """``data * scale_inv`` (each tile's), float32: the inverse of :func:`quantize_blockwise`
    up to the FP8 rounding. The product is one float32 rounding (exact with power-of-two
    scales); the exact value of an element is ``float64(data) * float64(scale_inv)``."""
    per_element = expand_tiles(scale_inv.to(torch.float32), tile, data.shape)
    return data.to(torch.float32) * per_element
