"""One GEMM operand as verification reads it, whatever backend cast it.

Every GEMM of a linear layer is read in one orientation, ``A @ B.T`` with both operands
``[rows, K]`` (``K`` the inner dim, last), so that a scale along the inner dim is one
per row and a block runs along the row::

    forward      A = input        [tokens, in]    B = weight     [out, in]
    grad_input   A = grad_output  [tokens, out]   B = weight.T   [in, out]
    grad_weight  A = grad_output.T [out, tokens]  B = input.T    [in, tokens]

An :class:`Operand` holds what the GEMM multiplied: the element values (exactly, in
float32) and the scales as the backend stored them, so that two casts compare bit for
bit, plus a description of the format (:attr:`Operand.format`). Readers turn each
backend's quantized tensor into one: amped's ``Float8Tensor`` and ``BlockTensor``,
torchao's ``Float8TrainingTensor`` and ``MXTensor`` (recognised by their attributes, so
that nothing here imports torchao), and a plain high-precision tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from amped.lowp.float8.blockwise import BlockwiseTensor
from amped.lowp.float8.cast import Float8Tensor
from amped.lowp.mx.block_cast import BlockTensor

__all__ = ["Operand", "from_amped", "from_gemm_arg", "plain", "transposed"]

_FP8_NAMES = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


@dataclass(frozen=True)
class Operand:
    """One GEMM operand, ``[rows, K]``.

    Attributes:
        element: the element format: ``"e4m3"``, ``"e5m2"``, ``"e2m1"``, or the dtype
            of a high-precision operand (``"bfloat16"``, ``"float32"``, ...).
        scaling: ``"tensorwise"``, ``"rowwise"``, ``"block32"``, ``"block16"`` or
            ``"none"`` (high precision).
        scale_format: ``"float32"`` (FP8: ``data = x * scale``), ``"e8m0"`` (MX:
            ``x ~= elements * 2**(bits - 127)``), ``"e4m3*float32"`` (NVFP4: an E4M3
            block scale times a float32 tensor scale) or ``"none"``.
        elements: the element values in float32, exactly (the operand itself when high
            precision).
        scale: the scales as stored: float32 (FP8, ``[]`` or ``[rows, 1]``), the
            uint8 bits of the block scales (``[rows, K // block]``), or None.
        tensor_scale: NVFP4's float32 tensor scale, else None.
    """

    element: str
    scaling: str
    scale_format: str
    elements: torch.Tensor
    scale: torch.Tensor | None = None
    tensor_scale: torch.Tensor | None = None

    @property
    def low_precision(self) -> bool:
        return self.scaling != "none"

    @property
    def format(self) -> str:
        """What ran, in words: ``"e4m3 rowwise, float32 scale"``."""
        if not self.low_precision:
            return f"{self.element} (no low-precision cast)"
        return f"{self.element} {self.scaling}, {self.scale_format} scale"

    def dequantized(self) -> torch.Tensor:
        """The values the GEMM multiplied, in float64 (exact for every power-of-two
        scale; one float64 rounding per element otherwise)."""
        x = self.elements.to(torch.float64)
        if self.scale is None:
            return x
        if self.scale_format == "float32":
            return x / self.scale.to(torch.float64)
        if self.scale_format == "e8m0":
            exponent = self.scale.to(torch.float64) - 127
            block = torch.exp2(exponent).repeat_interleave(x.shape[-1] // exponent.shape[-1], -1)
            return x * block
        block = self.scale.view(torch.float8_e4m3fn).to(torch.float64)
        block = block.repeat_interleave(x.shape[-1] // block.shape[-1], -1)
        assert self.tensor_scale is not None  # NVFP4 always has one
        return x * block * self.tensor_scale.to(torch.float64)


def plain(x: torch.Tensor) -> Operand:
    """A high-precision operand (no cast)."""
    name = str(x.dtype).removeprefix("torch.")
    return Operand(name, "none", "none", x.detach().to(torch.float32))


def _fp8(data: torch.Tensor, scale: torch.Tensor) -> Operand:
    scale = scale.detach().to(torch.float32)
    scaling = "tensorwise" if scale.numel() == 1 else "rowwise"
    if scaling == "tensorwise":
        scale = scale.reshape(())
    elif scale.shape[0] != data.shape[0]:  # one scale per column: not along K
        scaling = "columnwise"
    element = _FP8_NAMES.get(data.dtype, str(data.dtype))
    return Operand(element, scaling, "float32", data.to(torch.float32), scale)


def _block(cast: BlockTensor) -> Operand:
    fmt = cast.format
    element = "e2m1" if fmt.is_fp4 else _FP8_NAMES[fmt.elem_dtype]
    scale_format = "e8m0" if fmt.is_mx else "e4m3*float32"
    elements = cast.elements.to(torch.float32)
    scale = cast.scale_bits.reshape(elements.shape[0], -1)
    block = elements.shape[-1] // scale.shape[-1]
    return Operand(element, f"block{block}", scale_format, elements, scale, cast.tensor_scale)


def from_amped(
    high: torch.Tensor | None, low: Float8Tensor | BlockwiseTensor | BlockTensor | None
) -> Operand:
    """An operand amped's layer reported to its observer (``lowp.health.record_gemm``).
    Never blockwise FP8: :func:`amped.verify` refuses ``fp8-blockwise`` first."""
    assert not isinstance(low, BlockwiseTensor)
    if isinstance(low, Float8Tensor):
        return _fp8(low.data, low.scale)
    if isinstance(low, BlockTensor):
        return _block(low)
    assert high is not None  # record_gemm passes one of the two
    return plain(high)


def transposed(op: Operand) -> Operand:
    """The operand of the transposed tensor (FP8 scales only: a block cast runs along
    one dim and cannot be read along the other)."""
    scale = op.scale
    if scale is not None and scale.dim() == 2:
        scale = scale.t()
    scaling = {"rowwise": "columnwise", "columnwise": "rowwise"}.get(op.scaling, op.scaling)
    return Operand(op.element, scaling, op.scale_format, op.elements.t(), scale, op.tensor_scale)


def from_gemm_arg(arg: Any, transpose: bool) -> Operand | None:
    """The operand of one argument of a GEMM op (``aten.mm(a, b)``: ``a`` as it is,
    ``b`` with ``transpose``), or None for a quantized tensor type this does not read.

    torchao's ``Float8TrainingTensor`` (``_data`` and ``_scale``, ``data = x * scale``)
    and ``MXTensor`` (``qdata`` and E8M0 ``scale``) are read by their attributes.
    """
    if hasattr(arg, "_data") and hasattr(arg, "_scale"):  # torchao Float8TrainingTensor
        op = _fp8(arg._data, arg._scale)
        return transposed(op) if transpose else op
    if hasattr(arg, "qdata") and hasattr(arg, "elem_dtype") and hasattr(arg, "block_size"):
        return _mx(arg, transpose)
    plain_type = type(arg) is torch.Tensor or isinstance(arg, torch.nn.Parameter)
    if plain_type and arg.dtype not in _FP8_NAMES:  # FP8 bytes without their scales: unread
        return plain(arg.t() if transpose else arg)
    return None


def _mx(arg: Any, transpose: bool) -> Operand | None:
    """A torchao ``MXTensor`` (FP8 elements, unswizzled E8M0 scales)."""
    if getattr(arg, "is_swizzled_scales", False) or arg.elem_dtype not in _FP8_NAMES:
        return None
    data = arg.qdata.t() if transpose else arg.qdata
    scale = arg.scale.t() if (transpose and arg.scale.dim() == 2) else arg.scale
    rows, k = data.shape
    bits = scale.view(torch.uint8).reshape(rows, k // arg.block_size)
    element = _FP8_NAMES[arg.elem_dtype]
    return Operand(
        element, f"block{arg.block_size}", "e8m0", data.to(torch.float32), bits.contiguous()
    )
