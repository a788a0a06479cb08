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

elements saturate to the element's range and round to nearest even. The GEMM multiplies
the block values of both operands (exact in bfloat16) with float32 accumulation and, for
NVFP4, scales the accumulator by the two tensor scales, as the block-scaled tensor-core
kernels do; the result is rounded to the input's dtype once and the bias added.
"""

from __future__ import annotations

import torch

from amped.exporting.formats import ExportFormat
from amped.lowp.float8.gemm import gemm_dtype

__all__ = ["ServedLinear", "round_e2m1"]

_E2M1_MAX = 6.0
_E4M3_MAX = 448.0


def round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """``v`` (float32, within +-6) rounded to the nearest E2M1 value, ties to even:
    the grid's spacing is 0.5 below 2, 1 up to 4, 2 up to 6."""
    magnitude = v.abs()
    exponent = torch.floor(torch.log2(magnitude.clamp(min=1.0)))
    step = torch.exp2(exponent - 1)  # 0.5 in [0, 2), 1 in [2, 4), 2 in [4, 6]
    return torch.copysign(torch.round(magnitude / step) * step, v)  # round: half to even


def _mx_values(x: torch.Tensor, fmt: ExportFormat) -> torch.Tensor:
    blocks = x.to(torch.float32).unflatten(-1, (-1, fmt.block.block_size))
    elem_max = fmt.block.elem_max
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    exponent = torch.ceil(torch.log2(amax / elem_max)).clamp(-127, 127)
    # a block of (near) zeros, amax below elem_max * 2**-127: kept at scale 2**-127
    # and not divided (as torchao and the MX recipes do), so its elements round to 0
    divisor = torch.where(exponent == -127, 1.0, torch.exp2(exponent))
    scaled = (blocks / divisor).clamp(-elem_max, elem_max)
    if fmt.block.is_fp4:
        rounded = round_e2m1(scaled)
    else:
        rounded = scaled.to(fmt.block.elem_dtype).to(torch.float32)
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
        if torch.is_autocast_enabled(device_type):
            x = x.to(torch.get_autocast_dtype(device_type))
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
