"""``BlockLinear``: an ``nn.Linear`` whose three GEMMs run in a block-scaled format.

Each GEMM casts both operands with blocks along its inner dim (what block GEMM kernels
take), so each operand is cast once per GEMM it enters::

    output      = input       @ weight.T    blocks along in_features
    grad_input  = grad_output @ weight      blocks along out_features
    grad_weight = grad_output.T @ input     blocks along tokens

The tokens of the grad-weight GEMM are padded with zero rows to a multiple of the block
(a zero row adds exact zeros to the product, and a block's amax is unchanged by zeros).
With ``weight_2d`` one 16x16-tile cast of the weight serves both GEMMs it enters: the
forward's operand is saved for backward, which reads it transposed (so a step holds
the weight's block values, a bfloat16 copy of it under bfloat16 autocast, from forward
to backward, as torch autocast's weight cache holds a cast weight). With
``stochastic_rounding`` both casts of grad_output round stochastically, drawing from a
generator seeded by ``(seed, draws)``, two int64 numbers in the buffer ``fp8_rng``
(so a resumed run draws what the uninterrupted one would). With ``hadamard`` the
grad-weight GEMM's operands are rotated along the tokens first (:mod:`.hadamard`), inside
their cast kernels.

What backward needs otherwise is saved in high precision (input and weight), as
torchao's MX training does, and cast again along the other dims. Bias, autocast and
Conv1D are handled as in :class:`~amped.lowp.Float8Linear`.
"""

from __future__ import annotations

from typing import Any

import torch

from amped._internal.errors import type_error
from amped.lowp.conv1d import (
    is_conv1d,
    is_linear_like,
    linear_dims,
    linear_forward,
    low_precision_class,
)
from amped.lowp.float8.gemm import gemm_dtype
from amped.lowp.health import record_gemm
from amped.lowp.mx.block_cast import BlockTensor, check_block_multiple
from amped.lowp.mx.block_config import BlockConfig
from amped.lowp.mx.block_format import BlockFormat
from amped.lowp.mx.block_gemm import has_block_scaled_mm, operand_mm, require_block_scaled_mm
from amped.lowp.mx.block_kernel import TILE
from amped.lowp.mx.block_operand import BlockOperand, block_operand
from amped.lowp.mx.fsdp_block_wire import gathered_block
from amped.lowp.mx.hadamard import HADAMARD_SIZE, hadamard_rows, hadamard_signs

__all__ = ["BlockLinear"]


def _pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = -x.shape[0] % multiple
    return x if extra == 0 else torch.cat([x, x.new_zeros(extra, x.shape[1])])


def _saved_tiles(wq: BlockOperand) -> tuple[torch.Tensor | None, ...]:
    """The tensors of a weight's 16x16-tile operand, for ``save_for_backward``: values,
    tensor scale, and the cast's elements and scale bits (None where absent)."""
    cast = wq.cast
    elements, scale_bits = (None, None) if cast is None else (cast.elements, cast.scale_bits)
    return wq.values, wq.tensor_scale, elements, scale_bits


def _transposed_tiles(
    tiles: list[torch.Tensor | None], fmt: BlockFormat, dtype: torch.dtype
) -> BlockOperand:
    """The grad-input GEMM's weight operand (``weight.T``, blocked along out_features)
    from the forward's 16x16-tile operand (:func:`_saved_tiles`): each tile's values and
    scale read along the other dim, values in ``dtype`` (exact: at most 6 significant bits)."""
    values, tensor_scale, elements, scale_bits = tiles
    if values is not None:
        values = values.to(dtype)
    cast = None
    if elements is not None and scale_bits is not None:
        # one scale per tile and 16 rows, as block_operand lays out a dim-0 tile cast
        per_rows = scale_bits[::TILE].repeat_interleave(TILE, dim=1)
        cast = BlockTensor(elements, per_rows, tensor_scale, fmt)
    return BlockOperand(values, tensor_scale, cast).t()


class _BlockLinearFunction(torch.autograd.Function):
    """``x @ weight.T`` with the output, grad-input and grad-weight GEMMs block-scaled."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, layer: BlockLinear) -> Any:
        x2 = x.reshape(-1, x.shape[-1])
        xq = layer.block_operand(x2, x.dtype)
        wq = layer.block_operand(weight, x.dtype, weight=True)
        out = operand_mm(xq, wq, x.dtype, emulate=layer.fp8_emulate)
        operands = {"input": (x2, xq.cast), "weight": (weight, wq.cast)}
        mode = layer.block_config.scale_mode  # how the MX probes read the scales
        record_gemm(layer, "forward", "output", out, operands, scale_mode=mode)
        # 16x16 tiles are the same read along either dim: backward transposes this
        # operand instead of casting the weight again (holding its values until then)
        tiles = _saved_tiles(wq) if layer.block_config.weight_2d else ()
        ctx.save_for_backward(x2, weight, *tiles)
        ctx.w_format = layer.block_config.format
        ctx.layer, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = layer, x.shape, x.dtype, weight.dtype
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        layer: BlockLinear = ctx.layer
        x2, weight, *tiles = ctx.saved_tensors
        go = grad.reshape(-1, grad.shape[-1])
        generator = layer.rounding_generator()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            goq = layer.block_operand(go, grad.dtype, generator=generator)
            if tiles:  # the forward's 16x16 tiles
                wq = _transposed_tiles(tiles, ctx.w_format, gemm_dtype(grad.dtype, grad.device))
            else:  # weight.T blocked along out_features: cast in weight's layout, no copy
                wq = layer.block_operand(weight, grad.dtype, dim=0, weight=True).t()
            grad_x = operand_mm(goq, wq, grad.dtype, emulate=layer.fp8_emulate)
            operands = {"grad_output": (go, goq.cast), "weight": (weight.t(), wq.cast)}
            mode = layer.block_config.scale_mode
            record_gemm(layer, "grad_input", "grad_input", grad_x, operands, scale_mode=mode)
            grad_x = grad_x.reshape(ctx.x_shape).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            cfg = layer.block_config
            multiple = max(cfg.format.block_size, HADAMARD_SIZE if cfg.hadamard else 1)
            go_rows, x_rows = _pad_rows(go, multiple), _pad_rows(x2.to(go.dtype), multiple)
            signs = layer.hadamard_signs() if cfg.hadamard else None
            # Both blocked along the tokens (rotated first, inside the cast, under
            # hadamard), cast in their own layout and used transposed
            go_t = layer.block_operand(
                go_rows, grad.dtype, dim=0, generator=generator, hadamard_signs=signs
            ).t()
            x_t = layer.block_operand(x_rows, grad.dtype, dim=0, hadamard_signs=signs).t()
            grad_w = operand_mm(go_t, x_t, grad.dtype, emulate=layer.fp8_emulate)
            if signs is not None and getattr(layer, "fp8_observer", None) is not None:
                # what the casts saw, for the monitor's counts (the same bits)
                go_rows = hadamard_rows(go_rows.to(torch.float32), signs)
                x_rows = hadamard_rows(x_rows.to(torch.float32), signs)
            operands = {"grad_output": (go_rows.t(), go_t.cast), "input": (x_rows.t(), x_t.cast)}
            mode = cfg.scale_mode
            record_gemm(layer, "grad_weight", "grad_weight", grad_w, operands, scale_mode=mode)
            grad_w = grad_w.to(ctx.w_dtype)
        return grad_x, grad_w, None


class BlockLinear(torch.nn.Linear):
    """An ``nn.Linear`` that computes in MXFP8, MXFP4 or NVFP4 (:mod:`.block_linear`).

    Made in place from an ``nn.Linear`` or a transformers ``Conv1D`` by
    :meth:`convert_`; :func:`amped.lowp.convert_to_low_precision` does that for a whole model.

    Attributes:
        block_config: the :class:`~amped.lowp.mx.block_config.BlockConfig`.
        fp8_emulate: whether GEMMs are emulated (no block GEMM on the device).
        fp8_rng: int64 ``[seed, draws]`` of stochastic rounding (a buffer).
    """

    weight_transposed = False
    block_config: BlockConfig
    fp8_emulate: bool
    fp8_rng: torch.Tensor

    @classmethod
    def convert_(
        cls,
        linear: torch.nn.Module,
        config: BlockConfig,
        emulate: bool | None = None,
        seed: int = 0,
    ) -> BlockLinear:
        """Turn ``linear`` into a BlockLinear in place and return it.

        Args:
            linear: an ``nn.Linear`` or transformers ``Conv1D`` (exactly that class).
            config: the block config.
            emulate: force (True) or forbid (False, sm100 GPUs only) emulated GEMMs;
                default: emulate where the device has no block-scaled GEMM.
            seed: this layer's seed for stochastic rounding and Hadamard signs.

        Raises:
            TypeError: another module type.
            ValueError: a dim that is not a multiple of the block size.
            RuntimeError: ``emulate=False`` on a device without block GEMMs.
        """
        if not is_linear_like(linear):
            raise type_error(
                "BlockLinear converts torch.nn.Linear and transformers Conv1D modules only",
                "type(linear)",
                type(linear),
            )
        in_features, out_features = linear_dims(linear)
        check_block_multiple(config.format, "in_features", (in_features,))
        check_block_multiple(config.format, "out_features", (out_features,))
        weight = linear.weight
        assert isinstance(weight, torch.Tensor)  # is_linear_like
        device = weight.device
        if emulate is False:
            require_block_scaled_mm(device)
        if is_conv1d(linear):
            linear.__class__ = low_precision_class(cls, type(linear))
        else:
            linear.__class__ = cls
        layer: BlockLinear = linear  # type: ignore[assignment]
        layer.in_features, layer.out_features = in_features, out_features
        layer.block_config = config
        layer.fp8_emulate = (not has_block_scaled_mm(device)) if emulate is None else emulate
        rng = torch.tensor([config.seed + seed, 0], dtype=torch.int64, device=device)
        layer.register_buffer("fp8_rng", rng)
        return layer

    def block_operand(
        self,
        x: torch.Tensor,
        out_dtype: torch.dtype,
        *,
        dim: int = -1,
        weight: bool = False,
        generator: torch.Generator | None = None,
        hadamard_signs: torch.Tensor | None = None,
    ) -> BlockOperand:
        """``x`` (2-D) cast to the layer's format, blocks along ``dim``, for a GEMM with
        an ``out_dtype`` result: block values when emulated, the cast (elements and
        scales) for a hardware GEMM or a health monitor. ``weight``: the weight's cast
        (16x16 tiles under ``weight_2d``); ``hadamard_signs``: rotate the rows first
        (:func:`~amped.lowp.mx.block_operand.block_operand`). A weight FSDP2 all-gathered in
        NVFP4 gives the gathered cast instead (:mod:`amped.lowp.mx.fsdp_block_wire`)."""
        cfg = self.block_config
        observed = getattr(self, "fp8_observer", None) is not None
        gathered = gathered_block(x) if weight else None
        if gathered is not None:  # FSDP2 all-gathered it cast (amped.lowp.mx.fsdp_block_wire)
            dtype = gemm_dtype(out_dtype, x.device) if self.fp8_emulate else None
            return gathered.operand(dim, dtype, keep_cast=observed or not self.fp8_emulate)
        return block_operand(
            x,
            cfg.format,
            cfg.scale_mode,
            dim=dim,
            tile_2d=weight and cfg.weight_2d,
            dtype=gemm_dtype(out_dtype, x.device) if self.fp8_emulate else None,
            generator=generator,
            keep_cast=observed or not self.fp8_emulate,
            hadamard_signs=hadamard_signs,
        )

    def rounding_generator(self) -> torch.Generator | None:
        """A generator for this backward's stochastic rounding (None when off); each
        call advances the draw count in ``fp8_rng``."""
        if not self.block_config.stochastic_rounding:
            return None
        seed, draws = (int(v) for v in self.fp8_rng.tolist())
        self.fp8_rng[1] += 1
        generator = torch.Generator(self.fp8_rng.device)
        return generator.manual_seed((seed << 32) + draws)

    def hadamard_signs(self) -> torch.Tensor:
        """The signs (float32, 16, on the layer's device) of this layer's 16x16 random
        Hadamard block (:func:`~amped.lowp.mx.hadamard.random_hadamard` of its seed), which
        the casts rotate with (:func:`~amped.lowp.mx.hadamard.hadamard_rows`)."""
        return hadamard_signs(int(self.fp8_rng[0])).to(self.fp8_rng.device)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear_forward(self, _BlockLinearFunction, input)

    def extra_repr(self) -> str:
        emulated = ", emulated" if self.fp8_emulate else ""
        return f"{super().extra_repr()}, block={self.block_config}{emulated}"
