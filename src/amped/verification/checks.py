"""One layer's step against amped's reference: every cast bit for bit, every GEMM
output within its bound (:mod:`amped.verification.bound`), and the flags.

A cast is compared with the reference cast of the same high-precision tensor; a GEMM's
output with the exact product of the operands it multiplied (so a wrong cast is
flagged once, as a cast, and a GEMM that mishandles right casts as an output). A cast
that differs is named by what differs: no cast at all (``fallback``), another element
format, another scale rule (the alternative rule that reproduces it, where one does),
or the elements alone.
"""

from __future__ import annotations

import torch

from amped.lowp.convert import LowPrecisionConfig
from amped.lowp.health import ROLES
from amped.verification.bound import gemm_bound
from amped.verification.capture import Gemm, LayerRecord
from amped.verification.operands import Operand
from amped.verification.reference import LayerInputs, alternatives, reference_operands
from amped.verification.report import CastResult, Flag, GemmResult

__all__ = ["check_layer"]

OPERANDS = {
    "forward": ("input", "weight"),
    "grad_input": ("grad_output", "weight"),
    "grad_weight": ("grad_output", "input"),
}
"""The operands ``A`` and ``B`` of each GEMM (:mod:`amped.verification.operands`)."""


def _bits(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    return x.view(torch.int32) if x.dtype is torch.float32 else x


def _mismatched(ran: Operand, ref: Operand) -> tuple[int, int]:
    """(elements, scales) that differ bit for bit; -1 where shapes differ."""
    if ran.elements.shape != ref.elements.shape:
        return -1, -1
    elements = int((_bits(ran.elements) != _bits(ref.elements)).sum())
    scales = 0
    for mine, theirs in ((ran.scale, ref.scale), (ran.tensor_scale, ref.tensor_scale)):
        if mine is None or theirs is None:
            scales += int((mine is None) != (theirs is None))
        elif mine.shape != theirs.shape:
            return elements, -1
        else:
            scales += int((_bits(mine) != _bits(theirs)).sum())
    return elements, scales


def _output(record: LayerRecord, role: str) -> torch.Tensor | None:
    return {"forward": record.output, "grad_input": record.grad_input}.get(role, record.grad_weight)


def _compute_dtype(record: LayerRecord, observed: torch.Tensor) -> torch.dtype:
    """The coarser of the layer's compute dtype and the observed tensor's."""
    compute = record.output.dtype if record.output is not None else observed.dtype
    return max((compute, observed.dtype), key=lambda d: torch.finfo(d).eps)


class _LayerCheck:
    def __init__(self, record: LayerRecord, config: LowPrecisionConfig) -> None:
        self.record = record
        self.config = config
        self.flags: list[Flag] = []
        assert record.x is not None and record.output is not None  # the layer ran
        self.inputs = LayerInputs(
            record.x.to(record.output.dtype),
            record.weight,
            record.grad_output,
            record.rng,
            record.grad_input is not None,
        )
        self.reference = reference_operands(config, self.inputs)

    def flag(self, kind: str, role: str, message: str) -> None:
        self.flags.append(Flag(kind, self.record.name, role, message))

    def role(self, role: str) -> GemmResult | None:
        observed = _output(self.record, role)
        if observed is None or role not in self.reference:
            return None  # not computed in this step (an input that needs no gradient)
        gemm = self.record.gemms.get(role)
        if gemm is None:
            self.flag("not_run", role, "no GEMM of this role was seen inside the layer")
            return GemmResult(self.record.name, role, "not run")
        shape = (gemm.a.elements.shape[0], gemm.b.elements.shape[0])
        if tuple(observed.shape) != shape:
            self.flag(
                "not_run",
                role,
                f"the GEMM seen makes {list(shape)}, the layer's "
                f"{role} is {list(observed.shape)}: no GEMM of this role was seen",
            )
            return GemmResult(self.record.name, role, "not run")
        casts = self.casts(role, gemm)
        dtype = _compute_dtype(self.record, observed)
        bias = self.record.bias if role == "forward" else None
        a, b = gemm.a.dequantized(), gemm.b.dequantized()
        reference, bound = gemm_bound(a, b, dtype, bias)
        error = (observed.to(torch.float64) - reference).abs()
        outside = ~(error <= bound)  # NaN outside too
        ratio = error / bound
        max_ratio = float(ratio.nan_to_num(float("inf")).max())
        count = int(outside.sum())
        if count:
            self.flag(
                "output_bound",
                role,
                f"{count} of {outside.numel()} output elements outside the bound of float32 "
                f"accumulation (worst {max_ratio:.3g} times its bound)",
            )
        ran = "low precision" if gemm.a.low_precision or gemm.b.low_precision else "high precision"
        return GemmResult(
            self.record.name,
            role,
            ran,
            casts,
            float(error.nan_to_num(float("inf")).max()),
            float(bound.max()),
            max_ratio,
            count,
            self.record.rng if role != "forward" else None,
        )

    def casts(self, role: str, gemm: Gemm) -> tuple[CastResult, ...]:
        results = []
        fell_back = False
        for index, name in enumerate(OPERANDS[role]):
            ran = (gemm.a, gemm.b)[index]
            ref = self.reference[role][index]
            mismatched = self.compare(role, name, index, ran, ref)
            fell_back |= ref.low_precision and not ran.low_precision
            results.append(CastResult(name, ran.format, ref.format, mismatched))
        if fell_back:
            ran_as = gemm.a.element if not gemm.a.low_precision else gemm.b.element
            self.flag("fallback", role, f"ran in {ran_as}: no low-precision GEMM")
        return tuple(results)

    def compare(self, role: str, name: str, index: int, ran: Operand, ref: Operand) -> int:
        if not ref.low_precision and ran.low_precision:
            self.flag(
                "element_format",
                role,
                f"{name} cast to {ran.element} where the recipe keeps this GEMM in {ref.element}",
            )
            return -1
        if not ran.low_precision:  # high precision as the recipe says, or a fallback
            return 0 if not ref.low_precision else -1
        if ran.element != ref.element:
            self.flag(
                "element_format",
                role,
                f"{name} cast to {ran.element} where the recipe casts it to {ref.element}",
            )
            return -1
        if (ran.scaling, ran.scale_format) != (ref.scaling, ref.scale_format):
            self.flag(
                "scale_rule",
                role,
                f"{name} scaled {ran.scaling} ({ran.scale_format}) where "
                f"the recipe scales it {ref.scaling} ({ref.scale_format})",
            )
            return -1
        elements, scales = _mismatched(ran, ref)
        if elements == 0 and scales == 0:
            return 0
        if scales != 0:
            rule = self.matching_rule(role, index, ran)
            said = f"cast by {rule}" if rule else "scaled by no rule amped knows"
            self.flag(
                "scale_rule",
                role,
                f"{name}: {max(scales, 0)} scales differ from the recipe's; {said}",
            )
        else:
            self.flag("cast", role, f"{name}: {elements} elements differ, the scales agree")
        return max(elements, 0) + max(scales, 0)

    def matching_rule(self, role: str, index: int, ran: Operand) -> str | None:
        for description, config in alternatives(self.config):
            other = reference_operands(config, self.inputs).get(role)
            if other is not None and _mismatched(ran, other[index]) == (0, 0):
                return description
        return None


def check_layer(
    record: LayerRecord, config: LowPrecisionConfig
) -> tuple[list[GemmResult], list[Flag]]:
    """The results and flags of one layer the plan converts."""
    if record.x is None or record.output is None:
        flag = Flag("not_run", record.name, "forward", "the layer did not run in the step")
        return [GemmResult(record.name, "forward", "not run")], [flag]
    check = _LayerCheck(record, config)
    results = [result for role in ROLES if (result := check.role(role)) is not None]
    return results, check.flags
