"""``Float8Linear``: an ``nn.Linear`` whose three GEMMs run in FP8.

Forward casts input and weight, backward casts grad_output, each by its
:class:`~amped.lowp.float8.config.CastRule`, and each GEMM goes through
:func:`~amped.lowp.float8.gemm.scaled_mm`. What backward needs is saved quantized where the
forward cast can be reused (tensorwise input and weight: the FP8 bytes and a scale,
a quarter of a float32 copy; an emulating layer keeps the bfloat16 operand its cast
wrote instead, so its backward converts nothing); rowwise rules scale the backward
operands along another dim, so those save the high-precision tensor and cast it again.

A blockwise config (one scale per 1x128, 128x1 or 128x128 tile) runs its GEMMs in
:mod:`amped.lowp.float8.blockwise_linear` instead.

Bias is added after the GEMM in the output dtype. Under an autocast region the
input is first cast to the region's dtype (bfloat16 for the FP8 recipes); the layer
then runs with autocast off, so the policy never re-casts its float32 dequantization.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from amped._internal.errors import type_error, value_error
from amped.lowp.conv1d import (
    is_conv1d,
    is_linear_like,
    linear_dims,
    linear_forward,
    low_precision_class,
)
from amped.lowp.float8.blockwise_gemm import has_blockwise_scaled_mm
from amped.lowp.float8.blockwise_linear import BlockwiseLinearFunction
from amped.lowp.float8.cast import (
    Float8Tensor,
    Granularity,
    amax_of,
    quantize,
    quantize_rows_and_columns,
)
from amped.lowp.float8.config import CastRule, Float8Config
from amped.lowp.float8.delayed import (
    GRAD_OUTPUT,
    INPUT,
    WEIGHT,
    next_scale,
    propagate_nonfinite,
    reduce_max,
)
from amped.lowp.float8.fsdp_wire import gathered_fp8
from amped.lowp.float8.gemm import gemm_dtype, has_scaled_mm, high_precision_mm, scaled_mm
from amped.lowp.health import Operand, record_gemm

__all__ = ["Float8Linear"]


class _Float8LinearFunction(torch.autograd.Function):
    """``x @ weight.T`` with the output, grad-input and grad-weight GEMMs in FP8."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, layer: Float8Linear) -> Any:
        cfg = layer.float8_config
        x2 = x.reshape(-1, x.shape[-1])
        xq = layer.fp8_cast(x2, cfg.input, INPUT, dim=-1, out_dtype=x.dtype)
        wq = gathered_fp8(
            weight
        )  # FSDP2 all-gathered it cast already (amped.lowp.float8.fsdp_wire)
        if wq is None:
            wq = layer.fp8_cast(weight, cfg.weight, WEIGHT, dim=-1, out_dtype=x.dtype)
        out = scaled_mm(
            xq, wq.t(), x.dtype, emulate=layer.fp8_emulate, use_fast_accum=cfg.fast_accum_output
        )
        record_gemm(layer, "forward", "output", out, {"input": (x2, xq), "weight": (weight, wq)})
        ctx.reuse_x = cfg.input.granularity == "tensorwise" and not cfg.grad_weight_hp
        ctx.reuse_w = cfg.weight.granularity == "tensorwise" and cfg.w_gi == cfg.weight
        x_saved = _parts(xq) if ctx.reuse_x else (x2,)
        w_saved = _parts(wq) if ctx.reuse_w else (weight,)
        ctx.save_for_backward(*x_saved, *w_saved)
        ctx.x_parts = len(x_saved)
        ctx.dequantized = (xq.dequantized, wq.dequantized)
        ctx.fp8_dtypes = (xq.dtype, wq.dtype)
        ctx.layer, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = layer, x.shape, x.dtype, weight.dtype
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        layer: Float8Linear = ctx.layer
        cfg = layer.float8_config
        saved = list(ctx.saved_tensors)
        x_saved, saved = saved[: ctx.x_parts], saved[ctx.x_parts :]
        if ctx.reuse_x:
            x_q = _restored(x_saved, ctx.dequantized[0], ctx.fp8_dtypes[0])
        else:
            x2 = x_saved[0]
        w_gi = _restored(saved, ctx.dequantized[1], ctx.fp8_dtypes[1]) if ctx.reuse_w else None
        w_high = None if ctx.reuse_w else saved[0]
        go = grad.reshape(-1, grad.shape[-1])
        goq, go_gw = _grad_output_casts(ctx, layer, go)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            if w_gi is None:  # rowwise over the output dim: one scale per input feature
                w_gi = layer.fp8_cast(saved[0], cfg.w_gi, None, dim=0, out_dtype=grad.dtype)
            assert goq is not None  # cast whenever grad_input is needed
            grad_x = scaled_mm(goq, w_gi, grad.dtype, emulate=layer.fp8_emulate)
            operands: dict[str, Operand] = {"grad_output": (go, goq), "weight": (w_high, w_gi)}
            record_gemm(layer, "grad_input", "grad_input", grad_x, operands)
            grad_x = grad_x.reshape(ctx.x_shape).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            if cfg.grad_weight_hp:
                grad_w = high_precision_mm(go.t(), x2.to(go.dtype), layer.fp8_emulate)
                operands = {"grad_output": (go, None), "input": (x2, None)}
            else:
                if not ctx.reuse_x:  # one scale per input feature
                    x_q = layer.fp8_cast(x2, cfg.input, None, dim=0, out_dtype=grad.dtype)
                assert go_gw is not None  # cast whenever an FP8 grad_weight is needed
                grad_w = scaled_mm(go_gw.t(), x_q, grad.dtype, emulate=layer.fp8_emulate)
                x_high = None if ctx.reuse_x else x2
                operands = {"grad_output": (go, go_gw), "input": (x_high, x_q)}
            record_gemm(layer, "grad_weight", "grad_weight", grad_w, operands)
            grad_w = grad_w.to(ctx.w_dtype)
        return grad_x, grad_w, None


def _grad_output_casts(
    ctx: Any, layer: Float8Linear, go: torch.Tensor
) -> tuple[Float8Tensor | None, Float8Tensor | None]:
    """grad_output cast for the grad-input GEMM and for the grad-weight GEMM (None where
    that GEMM does not run in FP8). Tensorwise: one cast for both. Rowwise: one scale per
    token for grad-input, one per output feature for grad-weight; both at once when both
    GEMMs run (two passes over grad_output instead of four), only the one needed else."""
    rule, dtype = layer.float8_config.grad_output, go.dtype
    needs_gi = ctx.needs_input_grad[0]
    needs_gw = ctx.needs_input_grad[1] and not layer.float8_config.grad_weight_hp
    if rule.granularity == "tensorwise":
        goq = layer.fp8_cast(go, rule, GRAD_OUTPUT, dim=-1, out_dtype=dtype)
        return goq, goq
    if needs_gi and needs_gw:
        return layer.fp8_cast_rows_and_columns(go, rule, out_dtype=dtype)
    rows = layer.fp8_cast(go, rule, None, dim=-1, out_dtype=dtype) if needs_gi else None
    columns = layer.fp8_cast(go, rule, None, dim=0, out_dtype=dtype) if needs_gw else None
    return rows, columns


def _parts(q: Float8Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors of ``q`` to save for backward: the bytes and scale, or, where the cast
    wrote the GEMM's operand instead (an emulating layer), the scale and that operand
    (backward converts nothing; the bytes are computed from it if read)."""
    return (q.data, q.scale) if q.values is None else (q.scale, q.values)


def _restored(parts: list[torch.Tensor], dequantized: bool, dtype: torch.dtype) -> Float8Tensor:
    """The :class:`Float8Tensor` of FP8 ``dtype`` that :func:`_parts` saved."""
    if parts[0].dtype is dtype:
        return Float8Tensor(parts[0], parts[1])
    return Float8Tensor(None, parts[0], parts[1], dequantized, dtype)


# rewrite: keep-start (the old spelling, deprecated)
def _warn_fp8_config() -> None:
    warnings.warn(
        "Float8Linear.fp8_config is deprecated and will be removed in the next release; "
        "use Float8Linear.float8_config",
        DeprecationWarning,
        stacklevel=3,
    )


# rewrite: keep-end


class Float8Linear(torch.nn.Linear):
    """An ``nn.Linear`` that computes in FP8 (see :mod:`amped.lowp.float8.linear`).

    Made from an existing ``nn.Linear`` in place by :meth:`convert_` (parameters, hooks
    and the optimizer's references are kept); :func:`amped.lowp.convert_to_low_precision` does that
    for a whole model. A transformers ``Conv1D`` converts to a ``Float8Conv1D``, a
    subclass of this class and of Conv1D that uses its weight transposed
    (:mod:`amped.lowp.conv1d`).

    Attributes:
        float8_config: the :class:`~amped.lowp.Float8Config` of its casts.
        fp8_emulate: whether GEMMs are emulated (no FP8 GEMM on the device).
    """

    weight_transposed = False
    """True for a converted Conv1D, whose weight is stored ``[in, out]``."""
    float8_config: Float8Config
    fp8_emulate: bool
    fp8_started: bool
    fp8_amax_history: torch.Tensor
    fp8_scale: torch.Tensor
    fp8_updates: torch.Tensor
    fp8_pending: torch.Tensor
    fp8_max: torch.Tensor

    @classmethod
    def convert_(
        cls, linear: torch.nn.Linear, config: Float8Config, emulate: bool | None = None
    ) -> Float8Linear:
        """Turn ``linear`` into a Float8Linear in place and return it.

        Args:
            linear: an ``nn.Linear`` or transformers ``Conv1D`` (exactly that class).
            config: the cast rules.
            emulate: force (True) or forbid (False) emulated GEMMs; default: emulate
                where the device has no FP8 GEMM. A blockwise config emulates unless
                given ``emulate=False`` (its kernel path, for Hopper GPUs,
                :func:`~amped.lowp.float8.blockwise_gemm.has_blockwise_scaled_mm`, has not
                been run yet).
        """
        if not is_linear_like(linear):
            raise type_error(
                "Float8Linear converts torch.nn.Linear and transformers Conv1D modules only "
                "(a subclass may not call its own forward, as nn.MultiheadAttention's "
                "out_proj)",
                "type(linear)",
                type(linear),
            )
        device = linear.weight.device
        if is_conv1d(linear):
            linear.in_features, linear.out_features = linear_dims(linear)
            linear.__class__ = low_precision_class(cls, type(linear))
        else:
            linear.__class__ = cls
        layer: Float8Linear = linear  # type: ignore[assignment]
        layer.float8_config = config
        if config.blockwise:  # its kernel path is not validated yet: asked for only
            layer.fp8_emulate = True if emulate is None else emulate
            if not layer.fp8_emulate and not has_blockwise_scaled_mm(device):
                raise value_error(
                    "emulate=False with a blockwise config needs a Hopper GPU (compute "
                    "capability 9.x) and torch.nn.functional.scaled_mm; emulate instead",
                    "device",
                    device,
                )
        else:
            layer.fp8_emulate = (not has_scaled_mm(device)) if emulate is None else emulate
        layer.fp8_started = False
        if config.delayed is not None:
            n = config.delayed.history_len
            f32, dev = torch.float32, device
            maxima = [torch.finfo(r.dtype).max for r in (config.input, config.weight)]
            maxima.append(torch.finfo(config.grad_output.dtype).max)
            layer.register_buffer("fp8_amax_history", torch.zeros(3, n, dtype=f32, device=dev))
            layer.register_buffer("fp8_scale", torch.ones(3, dtype=f32, device=dev))
            layer.register_buffer("fp8_updates", torch.zeros((), dtype=torch.int64, device=dev))
            # Not a buffer: DDP broadcasts buffers from rank 0 at every forward, which would
            # overwrite the amaxes another rank saw in an earlier micro-batch.
            layer.fp8_pending = torch.zeros(3, dtype=f32, device=dev)
            fp8_max = torch.tensor(maxima, dtype=f32, device=dev)
            layer.register_buffer("fp8_max", fp8_max, persistent=False)
        return layer

    # rewrite: keep-start (the old spelling, deprecated)
    @property
    def fp8_config(self) -> Float8Config:
        """Deprecated: :attr:`float8_config` (removed in the next release)."""
        _warn_fp8_config()
        return self.float8_config

    @fp8_config.setter
    def fp8_config(self, config: Float8Config) -> None:
        _warn_fp8_config()
        self.float8_config = config

    # rewrite: keep-end

    @property
    def fp8_delayed(self) -> Any:
        """The :class:`~amped.lowp.float8.config.DelayedScaling` rule, or None for
        dynamic scaling."""
        return self.float8_config.delayed

    def fp8_cast(
        self, x: torch.Tensor, rule: CastRule, role: int | None, dim: int, out_dtype: torch.dtype
    ) -> Float8Tensor:
        """Quantize ``x`` by ``rule`` for a GEMM with an ``out_dtype`` result:
        dynamically, or with the delayed scale of ``role`` (:meth:`fp8_delayed_scale`).
        An emulating layer's cast also writes the GEMM's operand, the FP8 values in
        :func:`~amped.lowp.float8.gemm.gemm_dtype` (``.values``)."""
        values_dtype = gemm_dtype(out_dtype, x.device) if self.fp8_emulate else None
        power_of_2 = self.float8_config.power_of_2
        if self.float8_config.delayed is None or role is None:
            granularity: Granularity = "rowwise" if rule.granularity == "rowwise" else "tensorwise"
            return quantize(x, rule.dtype, granularity, dim, power_of_2, None, values_dtype)
        scale = self.fp8_delayed_scale(amax_of(x).to(torch.float32), role)
        return quantize(x, rule.dtype, scale=scale, values_dtype=values_dtype)

    def fp8_cast_rows_and_columns(
        self, x: torch.Tensor, rule: CastRule, out_dtype: torch.dtype
    ) -> tuple[Float8Tensor, Float8Tensor]:
        """:meth:`fp8_cast` of a rowwise ``rule`` along ``dim=-1`` and ``dim=0`` at once
        (:func:`~amped.lowp.float8.cast.quantize_rows_and_columns`; dynamic scaling only)."""
        values_dtype = gemm_dtype(out_dtype, x.device) if self.fp8_emulate else None
        power_of_2 = self.float8_config.power_of_2
        return quantize_rows_and_columns(x, rule.dtype, power_of_2, values_dtype)

    @torch.no_grad()
    def fp8_delayed_scale(
        self, amax: torch.Tensor, role: int, reduced: bool = False
    ) -> torch.Tensor:
        """The delayed scale tensor ``role`` casts with, given its float32 ``amax`` now
        (``reduced``: already the maximum over the ranks, as an FSDP2 shard's is).

        In training mode the amax is recorded for the next update; a layer in eval mode
        casts with the current scales and records nothing.
        """
        delayed = self.float8_config.delayed
        assert delayed is not None  # fp8_cast and the FSDP2 wire call it for delayed only
        if self.training:  # evaluation does not feed the history
            if self.fp8_pending.device != amax.device:  # the model moved
                self.fp8_pending = self.fp8_pending.to(amax.device)
            self.fp8_pending[role] = torch.maximum(self.fp8_pending[role], amax)
        if self.fp8_started:
            scale = self.fp8_scale[role]
        else:  # first step: this tensor's own amax, the same on every rank
            amax = amax if reduced else reduce_max(amax.clone())
            scale = next_scale(amax, self.fp8_max[role], self.fp8_scale[role], delayed.margin)
        return propagate_nonfinite(scale, amax)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.float8_config.blockwise:  # amped.lowp.float8.blockwise_linear
            return linear_forward(self, BlockwiseLinearFunction, input)
        return linear_forward(self, _Float8LinearFunction, input)

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args)
        if self.float8_config.delayed is not None:
            self.fp8_started = bool(self.fp8_updates > 0)

    def extra_repr(self) -> str:
        emulated = ", emulated" if self.fp8_emulate else ""
        return f"{super().extra_repr()}, fp8={self.float8_config}{emulated}"
