"""How a Float8 linear layer casts each GEMM operand: one immutable value per recipe.

A linear layer runs three GEMMs, and each operand is cast by its own rule::

    output      = input       @ weight.T        (forward)
    grad_input  = grad_output @ weight          (backward)
    grad_weight = grad_output.T @ input         (backward)

The named configs (:data:`FLOAT8_CONFIGS`) follow torchao's float8 training recipes
(tensorwise, rowwise, rowwise with a high-precision grad-weight GEMM), Transformer
Engine's delayed scaling, and DeepSeek-V3's blockwise scaling (Transformer Engine's
``Float8BlockScaling``, torchao's ``blockwise_fp8_training``).

A ``"blockwise"`` rule casts by tiles whose shape the operand's role sets
(:mod:`amped.lowp.float8.blockwise`): input and grad_output in 1x128 tiles for the
output and grad-input GEMMs and in 128x1 tiles for the grad-weight GEMM, the weight in
128x128 tiles for both of its GEMMs. A config is blockwise in all of its rules or in none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from amped._internal.errors import value_error
from amped.lowp.float8.cast import check_fp8_dtype, check_granularity

RuleGranularity = Literal["tensorwise", "rowwise", "blockwise"]
"""How a :class:`CastRule` scales: one scale per tensor, per row, or per tile."""

__all__ = ["FLOAT8_CONFIGS", "CastRule", "DelayedScaling", "Float8Config"]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


@dataclass(frozen=True)
class CastRule:
    """The FP8 dtype and scaling granularity of one GEMM operand."""

    dtype: torch.dtype = E4M3
    granularity: RuleGranularity = "tensorwise"

    def __post_init__(self) -> None:
        check_fp8_dtype(self.dtype)
        if self.granularity != "blockwise":
            check_granularity(self.granularity)

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.float8_')}/{self.granularity}"


MAX_HISTORY_LEN = 1 << 16
MAX_MARGIN = 64
"""The bounds :class:`DelayedScaling` accepts (see its validation)."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class DelayedScaling:
    """Transformer Engine's delayed scaling: scales from a history of past amaxes.

    After every optimizer step, for each of input, weight and grad_output::

        history = [amax of this step (max over ranks)] + history[:-1]
        amax    = max(history) if amax_compute == "max" else history[0]
        scale   = fp8_max / max(amax, 1e-12) / 2**margin   if 0 < amax < inf
                  previous scale                              otherwise
        scale   = clamp(scale, 2**-126, fp8_max / 1e-12)

    The amax is clamped as the dynamic path clamps it (:data:`amped.lowp.float8.cast.EPS`), so
    a step with a tiny amax cannot make a scale inf; the lower clamp keeps a scale
    non-zero (float32's smallest normal), so dequantizing never divides by zero. A
    tensor holding an inf or NaN casts to NaN (it is not saturated to a finite value):
    the step's loss is non-finite, as under dynamic scaling, and a monitor or a loss
    scaler can skip it.

    The first step, with no history yet, scales each tensor by its own amax (reduced
    over ranks), so it never starts from an arbitrary scale.

    Attributes:
        history_len: steps of amax kept per tensor (at least 1).
        amax_compute: ``"max"`` over the history or the ``"most_recent"`` amax.
        margin: extra headroom, in powers of two, below the FP8 maximum.
    """

    history_len: int = 16
    amax_compute: Literal["max", "most_recent"] = "max"
    margin: int = 0

    def __post_init__(self) -> None:
        if not _is_int(self.history_len) or not 1 <= self.history_len <= MAX_HISTORY_LEN:
            raise value_error(
                f"history_len is an int in [1, {MAX_HISTORY_LEN}] (steps of amax kept per "
                "tensor; Transformer Engine's default is 1024)",
                "history_len",
                self.history_len,
            )
        if self.amax_compute not in ("max", "most_recent"):
            raise value_error(
                "amax_compute is 'max' or 'most_recent'", "amax_compute", self.amax_compute
            )
        if not _is_int(self.margin) or not 0 <= self.margin <= MAX_MARGIN:
            raise value_error(
                f"margin is an int in [0, {MAX_MARGIN}]: the scale is fp8_max / amax / "
                "2**margin, and a larger margin leaves no FP8 value above zero for any "
                "ordinary amax (margin=160 made every scale 0 and every output NaN)",
                "margin",
                self.margin,
            )


@dataclass(frozen=True)
class Float8Config:
    """The cast rules of a Float8 linear layer's three GEMMs.

    Attributes:
        input, weight, grad_output: the rule of each operand where it first appears
            (input and weight in the output GEMM, grad_output in the grad-input GEMM).
        weight_for_grad_input: the weight's rule in the grad-input GEMM (default: ``weight``).
        grad_weight_hp: run the grad-weight GEMM in the layer's high precision.
        power_of_2: round every scale down to a power of two (blockwise: Transformer
            Engine's ``power_2_scale``; DeepSeek-V3 and torchao keep float32 scales).
        fast_accum_output: Hopper's fast accumulation for the output GEMM (GPU only).
        delayed: delayed (amax-history) scaling; tensorwise rules only.
    """

    input: CastRule = field(default_factory=CastRule)
    weight: CastRule = field(default_factory=CastRule)
    grad_output: CastRule = field(default_factory=lambda: CastRule(E5M2))
    weight_for_grad_input: CastRule | None = None
    grad_weight_hp: bool = False
    power_of_2: bool = False
    fast_accum_output: bool = True
    delayed: DelayedScaling | None = None

    def __post_init__(self) -> None:
        if self.weight_for_grad_input is None:
            object.__setattr__(self, "weight_for_grad_input", self.weight)
        rules = (self.input, self.weight, self.grad_output, self.weight_for_grad_input)
        blockwise = [r for r in rules if r is not None and r.granularity == "blockwise"]
        if blockwise and (len(blockwise) != len(rules) or self.delayed is not None):
            raise value_error(
                "A blockwise config casts every operand by tiles (input, weight, "
                "grad_output and weight_for_grad_input all 'blockwise', no delayed "
                "scaling): each GEMM multiplies two operands tiled along its inner dim; "
                "start from amped.lowp.CONFIGS['blockwise']",
                "rules",
                [str(r) for r in rules],
            )
        if self.delayed is not None:
            rules = (self.input, self.weight, self.grad_output, self.weight_for_grad_input)
            rowwise = [r for r in rules if r is not None and r.granularity != "tensorwise"]
            if rowwise:
                raise value_error(
                    "Delayed scaling keeps one amax history per tensor, so every cast rule "
                    "must be tensorwise",
                    "rule",
                    rowwise[0],
                )

    @property
    def blockwise(self) -> bool:
        """Whether the rules scale per tile (:mod:`amped.lowp.float8.blockwise`)."""
        return self.input.granularity == "blockwise"

    @property
    def w_gi(self) -> CastRule:
        """The weight's rule in the grad-input GEMM."""
        return self.weight_for_grad_input or self.weight

    def __str__(self) -> str:
        parts = [f"i:{self.input}", f"w:{self.weight}", f"go:{self.grad_output}"]
        if self.w_gi != self.weight:
            parts.append(f"w_gi:{self.w_gi}")
        if self.grad_weight_hp:
            parts.append("gw:hp")
        if self.delayed is not None:
            d = self.delayed
            parts.append(f"delayed(len={d.history_len},{d.amax_compute},margin={d.margin})")
        return ",".join(parts)


_ROWWISE = CastRule(E4M3, "rowwise")
_BLOCKWISE = CastRule(E4M3, "blockwise")

FLOAT8_CONFIGS: dict[str, Float8Config] = {
    "tensorwise": Float8Config(),
    "rowwise": Float8Config(_ROWWISE, _ROWWISE, _ROWWISE, power_of_2=True),
    "rowwise-gw-hp": Float8Config(
        _ROWWISE,
        _ROWWISE,
        _ROWWISE,
        weight_for_grad_input=CastRule(E4M3, "tensorwise"),
        grad_weight_hp=True,
        power_of_2=True,
    ),
    "delayed": Float8Config(delayed=DelayedScaling()),
    "blockwise": Float8Config(_BLOCKWISE, _BLOCKWISE, _BLOCKWISE),
}
"""The scaling recipes by name: torchao's three dynamic ones, delayed scaling, and
DeepSeek-V3's blockwise scaling (E4M3 everywhere, float32 scales; its power-of-two
variant is ``dataclasses.replace(FLOAT8_CONFIGS["blockwise"], power_of_2=True)``)."""
