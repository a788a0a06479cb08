"""What ``amped compare`` says about an FP8 recipe's GEMMs: one note from its monitor.

Each FP8 recipe trains with :func:`amped.monitor` attached (``every=50``; a step with an
inf or NaN in a GEMM or a gradient is skipped and counted as such). The report's notes
for the recipe then carry one line: the first non-finite value named (step, module,
GEMM role, tensor), or that there was none, with the worst underflow and saturation
fractions over the sampled steps and the audit's findings.
"""

from __future__ import annotations

from amped.recipes import TrainSetup, monitor
from amped.recipes.monitoring import Monitor

__all__ = ["HEALTH_EVERY", "attach_monitor", "health_note"]

HEALTH_EVERY = 50


def attach_monitor(setup: TrainSetup) -> Monitor | None:
    """A monitor on ``setup`` if it has FP8 layers, else None."""
    if setup.low_precision_layers is None:
        return None
    return monitor(setup, every=HEALTH_EVERY)


def health_note(health: Monitor | None) -> str | None:
    """One line for the recipe's notes (None without a monitor or a sampled step)."""
    if health is None or health.sampled_steps == 0:
        return None
    first = health.first_nonfinite
    head = "GEMM health: no inf/NaN" if first is None else f"GEMM health: first inf/NaN at {first}"
    if health.nonfinite_steps:
        head += f" ({len(health.nonfinite_steps)} step(s) skipped)"
    worst = {"underflow_fraction": (0.0, ""), "saturation_fraction": (0.0, "")}
    for layer, roles in health.read().items():
        for role, stats in roles.items():
            for key, (best, _) in worst.items():
                if stats[key] > best:
                    worst[key] = (stats[key], f"{layer} {role}")
    parts = [head]
    for key, label in (("underflow_fraction", "underflow"), ("saturation_fraction", "saturation")):
        value, where = worst[key]
        parts.append(f"worst {label} {value:.2%}" + (f" ({where})" if where else ""))
    parts.append("audit: " + ("; ".join(health.audit) if health.audit else "every layer ran FP8"))
    return "; ".join(parts)
