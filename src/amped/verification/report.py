"""The result of :func:`amped.verify`: per layer and GEMM role, what ran and how it
compares with amped's reference, and the flags; saved as ``verify.json``."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from amped._internal.files import write_files

__all__ = ["FLAG_KINDS", "SCHEMA", "CastResult", "Flag", "GemmResult", "VerifyReport"]

SCHEMA = "amped.verify/1"

FLAG_KINDS = {
    "fallback": "a GEMM the recipe runs in low precision ran without a low-precision cast",
    "element_format": "an operand cast to another element format than the recipe's",
    "scale_rule": "an operand scaled by another rule (rounding, granularity) than the recipe's",
    "cast": "an operand's elements differ from the reference cast, its scales agreeing",
    "output_bound": "a GEMM output outside the bound of float32 accumulation",
    "not_run": "a layer the plan converts whose GEMM did not run (or was not seen)",
}
"""Every kind of flag, with what it means."""


@dataclass(frozen=True)
class CastResult:
    """One operand of one GEMM.

    Attributes:
        operand: ``input``, ``weight`` or ``grad_output``.
        ran: the format the backend cast it to (:attr:`Operand.format
            <amped.verification.operands.Operand.format>`).
        expected: the format the recipe prescribes.
        mismatched: elements and scales that differ from amped's reference cast (0:
            bit for bit the reference); -1 where not comparable (another format).
    """

    operand: str
    ran: str
    expected: str
    mismatched: int


@dataclass(frozen=True)
class GemmResult:
    """One GEMM (``role``: ``forward``, ``grad_input`` or ``grad_weight``) of a layer.

    Attributes:
        ran: ``"low precision"``, ``"high precision"`` (no cast on either operand) or
            ``"not run"``.
        casts: the two operands.
        max_error: the largest ``|output - exact product of its operands|``.
        max_bound: the largest element's bound (:mod:`amped.verification.bound`).
        max_ratio: the largest error divided by its element's bound (at most 1 within
            the bound; ``inf`` for a non-finite output).
        outside: output elements outside their bound.
        random_state: the layer's stochastic-rounding ``seed, draws`` at this step,
            where it has one.
    """

    layer: str
    role: str
    ran: str
    casts: tuple[CastResult, ...] = ()
    max_error: float = 0.0
    max_bound: float = 0.0
    max_ratio: float = 0.0
    outside: int = 0
    random_state: tuple[int, int] | None = None


@dataclass(frozen=True)
class Flag:
    """One finding: its kind (:data:`FLAG_KINDS`), the layer, the GEMM role, and what
    was seen."""

    kind: str
    layer: str
    role: str
    message: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.layer} {self.role}: {self.message}"


def _finite(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`amped.verify` found.

    Attributes:
        backend: the backend that ran (``amped``, ``torchao``, or a custom one's name).
        recipe: the recipe it was checked against.
        layers: the layers the recipe's plan converts, in model order.
        gemms: one :class:`GemmResult` per layer and role that ran.
        flags: every :class:`Flag`; none when the run is the recipe, exactly.
    """

    backend: str
    recipe: str
    layers: tuple[str, ...]
    gemms: tuple[GemmResult, ...]
    flags: tuple[Flag, ...] = field(default=())

    @property
    def ok(self) -> bool:
        """Whether nothing was flagged."""
        return not self.flags

    def to_dict(self) -> dict[str, Any]:
        """The ``verify.json`` document (``"schema": "amped.verify/1"``)."""
        gemms = []
        for gemm in self.gemms:
            row = asdict(gemm)
            row["max_ratio"] = _finite(gemm.max_ratio)
            row["max_error"] = _finite(gemm.max_error)
            gemms.append(row)
        return {
            "schema": SCHEMA,
            "backend": self.backend,
            "recipe": self.recipe,
            "ok": self.ok,
            "layers": list(self.layers),
            "flags": [asdict(flag) for flag in self.flags],
            "gemms": gemms,
        }

    def save(self, out_dir: str | Path) -> Path:
        """Write ``out_dir/verify.json`` (the directory made if missing); returns its path."""
        path = Path(out_dir) / "verify.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_files([(path, json.dumps(self.to_dict(), indent=1) + "\n")])[0]

    def __str__(self) -> str:
        head = f"amped.verify: {self.backend} against {self.recipe}: "
        if self.ok:
            return head + f"{len(self.gemms)} GEMMs in {len(self.layers)} layers, no flags"
        return head + f"{len(self.flags)} flags\n" + "\n".join(f"  {f}" for f in self.flags)
