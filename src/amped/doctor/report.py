"""What :func:`amped.doctor.diagnose` found, as data, a plain-text summary and JSON.

The HTML page and its plot are the CLI's (:mod:`amped.cli.doctor.html`).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from amped._internal.jsonio import jsonable, to_json
from amped.doctor.gradients import GradientCheck
from amped.policy import Policy

UNDERFLOW_WARN = 0.01
"""A parameter whose gradient loses more than 1% of its non-zero values to underflow is
reported; below that, the lost values are too few to bias the update noticeably."""

__all__ = ["Culprit", "OpStat", "Report", "Suggestion", "policy_expression", "scale_code"]


@dataclass(frozen=True)
class OpStat:
    """One op call of the low-precision run, compared with the same call in float32."""

    index: int
    module: str
    op: str
    dtype: str
    amax: float
    amin: float
    n_inf: int
    n_nan: int
    underflow: float | None  # fraction of float32 non-zeros that are zero/subnormal here
    rel_error: float | None
    sqnr_db: float | None


@dataclass(frozen=True)
class Culprit:
    """The first op that produced a non-finite value."""

    phase: str  # "forward" or "backward"
    module: str
    op: str
    index: int
    source: str | None
    detail: str

    def __str__(self) -> str:
        where = f" at {self.source}" if self.source else ""
        return f"{self.phase}: {self.op} in {self.module or '<root>'}{where} ({self.detail})"


def policy_expression(policy: Policy) -> str:
    """Python that builds ``policy``: ``amped.Policy.preset(name, device_type)`` for a
    preset, else ``policy`` (the policy the caller passed, by that name)."""
    try:
        preset = Policy.preset(policy.name, policy.device_type)
    except (ValueError, TypeError):
        return "policy"
    return (
        f"amped.Policy.preset({policy.name!r}, {policy.device_type!r})"
        if preset == policy
        else "policy"
    )


def scale_code(device_type: str, scale: float) -> str:
    """Python that builds a GradScaler starting at ``scale``."""
    number = f"{scale:.1f}" if float(scale).is_integer() else repr(float(scale))
    return f"amped.GradScaler({device_type!r}, init_scale={number})"


@dataclass(frozen=True)
class Suggestion:
    """A fix the doctor re-ran: a policy (pass it to autocast) and/or a loss scale.

    ``code`` is the one line of Python that applies it (``import amped`` first): run,
    it builds the very policy (or GradScaler) the doctor verified.
    """

    description: str
    policy: Policy | None
    loss_scale: float | None
    verified: bool
    sqnr_db: float  # model output against float32 with the fix
    code: str | None = None
    why_not: str | None = None  # why the re-run did not verify it, when it did not
    absorbed: bool = False  # a backward overflow GradScaler's back-off reaches a fix for

    def __str__(self) -> str:
        if not self.verified:
            why = f"; {self.why_not}" if self.why_not else ""
            return f"not found: {self.description}{why}"
        if self.sqnr_db == math.inf:
            return f"{self.description}: no overflow, output identical to float32"
        return f"{self.description}: no overflow, output {self.sqnr_db:.1f} dB SQNR vs float32"


@dataclass
class Report:
    """Everything :func:`amped.doctor.diagnose` found. ``healthy`` says whether all is well."""

    device_type: str
    dtype: str
    loss_scale: float
    policy: Policy
    ops: list[OpStat]
    forward_culprit: Culprit | None
    backward_culprit: Culprit | None
    gradients: list[GradientCheck]
    nonfinite_grads: dict[str, int]
    recommended_scale: float | None
    loss_reference: float
    loss_target: float
    sqnr_db: float
    suggestion: Suggestion | None = field(default=None)

    @property
    def healthy(self) -> bool:
        return (
            self.forward_culprit is None
            and self.backward_culprit is None
            and not any(self.nonfinite_grads.values())
            and all(g.underflow <= UNDERFLOW_WARN and not g.overflows for g in self.gradients)
        )

    # --- data ------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        data = {
            "device_type": self.device_type,
            "dtype": self.dtype,
            "loss_scale": self.loss_scale,
            "policy": self.policy.name,
            "healthy": self.healthy,
            "loss": {"float32": self.loss_reference, self.dtype: self.loss_target},
            "output_sqnr_db": self.sqnr_db,
            "forward_culprit": asdict(self.forward_culprit) if self.forward_culprit else None,
            "backward_culprit": asdict(self.backward_culprit) if self.backward_culprit else None,
            "recommended_scale": self.recommended_scale,
            "gradients": [asdict(g) for g in self.gradients],
            "nonfinite_grads": self.nonfinite_grads,
            "ops": [asdict(o) for o in self.ops],
            "suggestion": None,
        }
        if self.suggestion is not None:
            data["suggestion"] = {
                "description": self.suggestion.description,
                "code": self.suggestion.code,
                "loss_scale": self.suggestion.loss_scale,
                "verified": self.suggestion.verified,
                "sqnr_db": self.suggestion.sqnr_db,
                "why_not": self.suggestion.why_not,
                "absorbed": self.suggestion.absorbed,
            }
        return jsonable(data)  # +-inf as "inf"/"-inf", NaN as null: amped's JSON rule

    def to_json(self, indent: int = 2) -> str:
        return to_json(self.to_dict(), indent=indent)

    def save_html(self, path: str | os.PathLike[str]) -> Path:
        """Write the report as a self-contained HTML page to ``path`` (atomically): the
        summary, the verified fix, a dynamic-range plot per module and every op;
        returns the path. ``amped doctor`` writes the same page as ``doctor.html``.

        The page is drawn by amped's CLI package, and its plot needs matplotlib (the
        ``[cli]`` extra: ``pip install -e '.[cli]'``); without it the page says so in
        place of the plot.
        """
        from amped.cli.doctor.html import save_doctor_html  # the CLI draws the pages

        return save_doctor_html(self, path)

    # --- text ------------------------------------------------------------------------

    def summary(self) -> str:
        """A few lines for a terminal or a log."""
        # bfloat16 has float32's exponent range: no loss scale to report unless one was set.
        scaled = self.dtype == "float16" or self.loss_scale != 1
        scale = f", loss scale {self.loss_scale:g}" if scaled else ""
        lines = [
            f"amped doctor: {self.dtype} on {self.device_type}{scale}, policy {self.policy.name!r}",
            f"  loss float32 {self.loss_reference:.6g}  {self.dtype} {self.loss_target:.6g}  "
            f"output SQNR {self.sqnr_db:.1f} dB",
        ]
        if self.healthy:
            lines.append("  healthy: no inf/NaN, no gradient underflow above 1%")
        for culprit in (self.forward_culprit, self.backward_culprit):
            if culprit is not None:
                lines.append(f"  first non-finite value, {culprit}")
        lossy = [g for g in self.gradients if g.underflow > 0]
        for g in sorted(lossy, key=lambda g: -g.underflow)[:5]:
            lines.append(
                f"  gradient {g.name}: {g.underflow:.1%} underflow at scale {g.scale:g} "
                f"(kept from scale {g.min_scale:g})"
            )
        # A forward overflow is not a loss-scale matter: no scale line then.
        forward_ok = self.forward_culprit is None
        if self.recommended_scale is not None and self.dtype == "float16" and forward_ok:
            lines.append(f"  largest safe loss scale: {self.recommended_scale:g}")
        if self.suggestion is not None and self.suggestion.absorbed:
            lines.append(
                f"  backward overflow at scale {self.loss_scale:g}: absorbed by dynamic loss "
                f"scaling (first safe scale {self.suggestion.loss_scale:g})"
            )
        if self.suggestion is not None:
            lines.append(f"  suggestion: {self.suggestion}")
            if self.suggestion.verified and self.suggestion.code:
                lines.append(f"  fix: {self.suggestion.code}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()
