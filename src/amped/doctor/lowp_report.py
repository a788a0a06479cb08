"""What :func:`amped.doctor.diagnose_low_precision` found: per-layer error of an FP8 or
block recipe, and cast statistics."""

from __future__ import annotations

import math
from dataclasses import dataclass

from amped.policy import Policy

__all__ = ["CastStat", "LowPrecisionLayerStat", "LowPrecisionReport", "LowPrecisionSuggestion"]

ROLES = ("output", "grad_input", "grad_weight")


def _db(value: float) -> str:
    return "exact" if value == math.inf else f"{value:.1f}"


@dataclass(frozen=True)
class CastStat:
    """How one GEMM operand sits in its FP8 dtype.

    Attributes:
        role: ``"input"``, ``"weight"`` or ``"grad_output"``.
        dtype: the FP8 dtype, e.g. ``"float8_e4m3fn"``.
        amax: the largest magnitude of the operand.
        headroom: ``fp8_max / max(|x| * scale)``: 1.0 when the scale puts the amax on
            the FP8 maximum (dynamic scaling), up to 2 with power-of-two scales, below
            1 when a (delayed) scale saturates.
        saturated: fraction of elements cast to the FP8 maximum.
        underflow: fraction of the non-zero elements cast to zero.
    """

    role: str
    dtype: str
    amax: float
    headroom: float
    saturated: float
    underflow: float


@dataclass(frozen=True)
class LowPrecisionLayerStat:
    """One Linear layer, run alone on the inputs and output gradients it saw in float32.

    ``sqnr_fp8`` and ``sqnr_bf16`` hold the SQNR (dB) of ``output``, ``grad_input`` and
    ``grad_weight`` against float32 under the FP8 recipe and under bfloat16 autocast:
    their difference is what FP8 costs this layer, free of errors from other layers.
    """

    name: str
    in_features: int
    out_features: int
    sqnr_fp8: dict[str, float]
    sqnr_bf16: dict[str, float]
    casts: tuple[CastStat, ...]
    keep_in_bf16: bool

    @property
    def worst_db(self) -> float:
        return min(self.sqnr_fp8.values())


@dataclass(frozen=True)
class LowPrecisionSuggestion:
    """A policy that keeps layers in bfloat16 (module rules ``"low"``), re-run and checked.

    ``verified`` is True when none of ``keep`` converts under ``policy`` and the whole
    model's output SQNR against float32 did not get worse (``model_sqnr`` vs the report's).
    """

    keep: tuple[str, ...]
    policy: Policy
    model_sqnr: float
    verified: bool

    def __str__(self) -> str:
        state = "verified" if self.verified else "NOT verified"
        rules = ", ".join(f'with_module("{n}", "low")' for n in self.keep)
        return (
            f"keep {', '.join(self.keep)} in bfloat16: policy.{rules} "
            f"({state}: model output {_db(self.model_sqnr)} dB)"
        )


@dataclass
class LowPrecisionReport:
    """Per converted layer what FP8 costs, the model's end-to-end error, and a fix."""

    recipe: str
    threshold_db: float
    layers: list[LowPrecisionLayerStat]
    not_converted: list[str]
    model_sqnr: float
    model_sqnr_bf16: float
    suggestion: LowPrecisionSuggestion | None

    @property
    def healthy(self) -> bool:
        """True when every converted layer keeps ``threshold_db`` on all three GEMMs."""
        return not any(layer.keep_in_bf16 for layer in self.layers)

    def layer(self, name: str) -> LowPrecisionLayerStat:
        for stat in self.layers:
            if stat.name == name:
                return stat
        raise KeyError(f"No converted layer {name!r}. Converted: {[s.name for s in self.layers]}")

    def __str__(self) -> str:
        lines = [
            f"FP8 doctor, recipe {self.recipe}: model output SQNR vs float32 "
            f"{_db(self.model_sqnr)} dB (bfloat16: {_db(self.model_sqnr_bf16)} dB)",
            f"  {'layer':<24}{'out':>7}{'g_in':>7}{'g_w':>7}  {'bf16 out/g_in/g_w':<19}"
            f"{'underflow i/w/go':<20}verdict",
        ]
        for s in self.layers:
            fp8 = "".join(f"{_db(s.sqnr_fp8[r]):>7}" for r in ROLES)
            bf16 = "/".join(_db(s.sqnr_bf16[r]) for r in ROLES)
            under = "/".join(f"{c.underflow:.0%}" for c in s.casts)
            verdict = f"keep in bf16 (< {self.threshold_db:g} dB)" if s.keep_in_bf16 else "ok"
            lines.append(f"  {s.name:<24}{fp8}  {bf16:<19}{under:<20}{verdict}")
        if self.not_converted:
            lines.append(f"  not converted (filter or policy): {', '.join(self.not_converted)}")
        if self.suggestion is not None:
            lines.append(f"  suggestion: {self.suggestion}")
        return "\n".join(lines)
