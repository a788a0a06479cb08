"""A Lightning callback that attaches :func:`amped.monitor` and logs its counters.

::

    from amped.integrations.lightning import Precision
    from amped.integrations.lightning_health import HealthCallback
    trainer = L.Trainer(plugins=[Precision("fp8-tensorwise")], callbacks=[HealthCallback(50)])

The monitor is attached to the plugin's setup once it exists (the first training
batch), and after every sampled step (``every``) the callback logs
:func:`amped.integrations.health.health_metrics` with ``LightningModule.log_dict``.
``callback.monitor`` holds the :class:`~amped.recipes.monitoring.Monitor` (first non-finite,
audit, ``read()``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from amped.integrations.health import health_metrics
from amped.recipes import monitor
from amped.recipes.monitoring import Monitor

__all__ = ["HealthCallback"]


class HealthCallback(pl.Callback):
    """Monitor the amped plugin's setup and log its per-GEMM health (see the module).

    Args:
        every: sample the counters (and log them) every this many optimizer steps.
        on_nonfinite: ``"skip"`` (default), ``"warn"`` or ``"raise"``.
        strict: make a failed audit fatal.
        record: a folder for the flight recorder's replay bundles (``amped.monitor``'s
            ``record=``; :func:`amped.doctor.replay` reruns one).
    """

    def __init__(
        self,
        every: int = 50,
        on_nonfinite: str = "skip",
        strict: bool = False,
        record: str | Path | None = None,
    ) -> None:
        self.every, self.on_nonfinite, self.strict = every, on_nonfinite, strict
        self.record = record
        self.monitor: Monitor | None = None
        self._logged_at = -1

    def _attach(self, trainer: pl.Trainer) -> None:
        setup = getattr(trainer.precision_plugin, "setup", None)
        if self.monitor is None and setup is not None:
            self.monitor = monitor(
                setup,
                self.every,
                on_nonfinite=self.on_nonfinite,
                strict=self.strict,
                record=self.record,
            )

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        self._attach(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        self._attach(trainer)  # autocast recipes build their setup at the first step
        health = self.monitor
        if health is None or health.step == 0 or health.step == self._logged_at:
            return
        if (health.step - 1) % health.every == 0:  # the step just ended was sampled
            pl_module.log_dict(health_metrics(health), on_step=True, on_epoch=False)
            self._logged_at = health.step

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if self.monitor is not None:
            self.monitor.detach()
