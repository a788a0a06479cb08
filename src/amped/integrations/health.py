"""The monitor's counters as flat metrics, for the frameworks' loggers and trackers.

``{"amped/<layer>/<role>/<stat>": value}`` for every layer and GEMM role of
:meth:`amped.recipes.monitoring.Monitor.read`, plus ``amped/nonfinite_steps`` and
``amped/audit_findings``. The Lightning callback
(:class:`amped.integrations.lightning_health.HealthCallback`) logs them through
``LightningModule.log_dict``; amped's Accelerate ``Accelerator.log_health`` through
``Accelerator.log`` (every tracker it was given).
"""

from __future__ import annotations

from amped.recipes.monitoring import Monitor

__all__ = ["LOGGED_STATS", "health_metrics"]

LOGGED_STATS = ("nonfinite", "underflow_fraction", "saturation_fraction", "scale_clamps", "amax")
"""What is logged per layer and role (the fractions rather than their raw counts)."""


def health_metrics(monitor: Monitor) -> dict[str, float]:
    """The monitor's counters, flattened (one sync, in :meth:`Monitor.read`)."""
    metrics: dict[str, float] = {
        "amped/nonfinite_steps": float(len(monitor.nonfinite_steps)),
        "amped/audit_findings": float(len(monitor.audit)),
    }
    for layer, roles in monitor.read().items():
        for role, stats in roles.items():
            for stat in LOGGED_STATS:
                metrics[f"amped/{layer}/{role}/{stat}"] = float(stats[stat])
    return metrics
