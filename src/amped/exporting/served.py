"""The served forward: a Linear that computes as an inference engine serves the format.

Written from the formats' public descriptions (OCP Microscaling 1.0; NVIDIA's NVFP4),
not from amped's training casts, so that comparing its logits with the training
forward's checks the export end to end. A :class:`ServedLinear` holds a weight read
back from the exported file as block values (``elements * block scale``) and, for
NVFP4, the weight's tensor scale (``1 / weight_global_scale``); each call quantizes the
input dynamically, blocks along in_features, as the recipe trained:

- MX: a block's scale is ``2 ** ceil(log2(amax / elem_max))``, the smallest power of
  two that does not saturate (the ``rceil`` rule, NVIDIA's and the MX recipes');
- NVFP4: a float32 tensor scale ``t = amax / (6 * 448)``, block scales
  ``e4m3(amax_block / 6 / t)`` (at least ``2 ** -6``), elements ``x / t / scale``;

- FP8 blockwise (:class:`ServedBlockwiseLinear`): DeepSeek-V3's 1x128 input tiles;

elements saturate to the element's range and round to nearest even. The GEMM multiplies
the block values of both operands (exact in bfloat16) with float32 accumulation and, for
NVFP4, scales the accumulator by the two tensor scales, as the block-scaled tensor-core
kernels do; the result is rounded to the input's dtype once and the bias added.
"""

from __future__ import annotations

import torch

from amped.exporting.formats import ExportFormat
from amped.lowp.float8.gemm import gemm_dtype

__all__ = ["ServedBlockwiseLinear", "ServedLinear", "round_e2m1"]

_E2M1_MAX = 6.0
_E4M3_MAX = 448.0
_TILE = 128  # DeepSeek-V3's tiles: 1x128 inputs, 128x128 weights


def round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """``v`` (float32, within +-6) rounded to the nearest E2M1 value, ties to even:
    the grid's spacing is 0.5 below 2, 1 up to 4, 2 up to 6."""
    magnitude = v.abs()
    exponent = torch.floor(torch.log2(magnitude.clamp(min=1.0)))
    step = torch.exp2(exponent - 1)  # 0.5 in [0, 2), 1 in [2, 4), 2 in [4, 6]
    return torch.copysign(torch.round(magnitude / step) * step, v)  # round: half to even


def _mx_values(x: torch.Tensor, fmt: ExportFormat) -> torch.Tensor:
    block = fmt.block_format()
    blocks = x.to(torch.float32).unflatten(-1, (-1, block.block_size))
    elem_max = block.elem_max
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    exponent = torch.ceil(torch.log2(amax / elem_max)).clamp(-127, 127)
    # a block of (near) zeros, amax below elem_max * 2**-127: kept at scale 2**-127
    # and not divided (as torchao and the MX recipes do), so its elements round to 0
    divisor = torch.where(exponent == -127, 1.0, torch.exp2(exponent))
    scaled = (blocks / divisor).clamp(-elem_max, elem_max)
    fp8 = not block.is_fp4
    rounded = scaled.to(block.elem_dtype).float() if fp8 else round_e2m1(scaled)
    return (rounded * torch.exp2(exponent)).flatten(-2)


def _nvfp4_values(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.to(torch.float32)
    amax = xf.abs().amax().clamp(min=1e-30)  # all zeros: a finite scale
    tensor_scale = amax / (_E4M3_MAX * _E2M1_MAX)
    blocks = xf.unflatten(-1, (-1, 16))
    ratio = blocks.abs().amax(dim=-1, keepdim=True) / _E2M1_MAX / tensor_scale
    scale = ratio.clamp(2.0**-6, _E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    scaled = (blocks * ((1.0 / tensor_scale) / scale)).clamp(-_E2M1_MAX, _E2M1_MAX)
    return (round_e2m1(scaled) * scale).flatten(-2), tensor_scale


def _in_autocast_dtype(x: torch.Tensor) -> torch.Tensor:
    """``x`` as an autocast region on its device casts a Linear's input (as it is where
    autocast is off); the layer then runs with autocast off, as the training layer did."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return x.to(torch.get_autocast_dtype(device_type))
    return x


class ServedLinear(torch.nn.Module):
    """``y = x @ weight.T + bias`` with ``x`` quantized per the format (see the module).

    Args:
        fmt: the export format.
        weight_values: the weight's block values ``[out, in]`` read from the file.
        weight_tensor_scale: NVFP4: ``1 / weight_global_scale`` (float32), else None.
        bias: the bias, or None.
    """

    weight_values: torch.Tensor
    weight_tensor_scale: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(
        self,
        fmt: ExportFormat,
        weight_values: torch.Tensor,
        weight_tensor_scale: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> None:
        super().__init__()
        self.fmt = fmt
        self.register_buffer("weight_values", weight_values)
        self.register_buffer("weight_tensor_scale", weight_tensor_scale)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device_type = x.device.type
        x = _in_autocast_dtype(x)
        with torch.autocast(device_type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1])
            dtype = gemm_dtype(x.dtype, x.device)
            weight = self.weight_values.to(dtype)  # exact: at most 6 significant bits
            if self.weight_tensor_scale is None:
                out = (_mx_values(x2, self.fmt).to(dtype) @ weight.t()).to(x.dtype)
            else:
                values, tensor_scale = _nvfp4_values(x2)
                alpha = tensor_scale * self.weight_tensor_scale  # float32, one rounding
                # the accumulator times alpha, rounded once (a CPU GEMM's alpha)
                empty = values.new_empty((), dtype=dtype)
                out = torch.addmm(
                    empty, values.to(dtype), weight.t(), beta=0, alpha=float(alpha)
                ).to(x.dtype)
            out = out.reshape(*x.shape[:-1], out.shape[-1])
            if self.bias is not None:
                out = out + self.bias.to(out.dtype)
        return out


def _blockwise_values(x: torch.Tensor, power_of_2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (2-D) cast to E4M3 in 1x128 tiles as DeepSeek-V3's recipe casts inputs:
    ``scale = 448 / amax`` (float64 quotient, rounded to float32; amax at least 1e-12),
    optionally rounded down to a power of two; elements ``e4m3(x * scale)`` saturated;
    the stored ``scale_inv = 1 / scale`` (float32). Returns the elements (float32) and
    ``scale_inv`` ``[rows, ceil(cols / 128)]``."""
    cols = x.shape[1]
    padded = torch.nn.functional.pad(x, (0, -cols % _TILE))
    tiles = padded.unflatten(-1, (-1, _TILE))
    amax = tiles.abs().amax(dim=-1, keepdim=True).to(torch.float64).clamp(min=1e-12)
    scale = (_E4M3_MAX / amax).to(torch.float32)
    if power_of_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    scaled = (tiles.to(torch.float32) * scale).clamp(-_E4M3_MAX, _E4M3_MAX)
    elements = scaled.to(torch.float8_e4m3fn).to(torch.float32).flatten(-2)[:, :cols]
    return elements, (1.0 / scale).squeeze(-1)


class ServedBlockwiseLinear(torch.nn.Module):
    """``y = x @ weight.T + bias`` as a blockwise FP8 kernel (DeepGEMM) computes it: the
    input cast in 1x128 tiles (:func:`_blockwise_values`), then per block of 128 inner
    indices a float32 partial product of the E4M3 values, scaled by the two tiles'
    ``scale_inv`` product and accumulated in float32; rounded to the input's dtype once.

    Args:
        weight: the E4M3 values ``[out, in]`` in float32, read from the file.
        scale_inv: the weight's ``weight_scale_inv`` ``[ceil(out / 128), ceil(in / 128)]``.
        bias: the bias, or None.
        power_of_2: the recipe's power-of-two scales for the inputs.
    """

    weight: torch.Tensor
    scale_inv: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        weight: torch.Tensor,
        scale_inv: torch.Tensor,
        bias: torch.Tensor | None,
        power_of_2: bool,
    ) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scale_inv", scale_inv)
        self.register_buffer("bias", bias)
        self.power_of_2 = power_of_2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device_type = x.device.type
        x = _in_autocast_dtype(x)
        with torch.autocast(device_type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1])
            values, x_scale_inv = _blockwise_values(x2, self.power_of_2)
            weight_t = self.weight.t()  # [in, out]
            n = weight_t.shape[1]
            # the weight's scale per k-block and output column: [ceil(in / 128), out]
            w_scale_inv = self.scale_inv.t().repeat_interleave(_TILE, dim=1)[:, :n]
            out = torch.zeros(values.shape[0], n, dtype=torch.float32, device=x.device)
            for block, start in enumerate(range(0, values.shape[1], _TILE)):
                stop = start + _TILE
                partial = values[:, start:stop] @ weight_t[start:stop]
                out += partial * (
                    x_scale_inv[:, block : block + 1] * w_scale_inv[block : block + 1]
                )
            out = out.to(x.dtype).reshape(*x.shape[:-1], n)
            if self.bias is not None:
                out = out + self.bias.to(out.dtype)
        return out
