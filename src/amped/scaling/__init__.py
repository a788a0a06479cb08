"""Scaling layer: ``GradScaler``, loss-scale strategies, records and checkpoints.

Exported: what a training loop and a strategy of one's own need. Everything else
(argument checks, the state-dict layout, distributed agreement, the archive reader) is
importable by module path but not public API. Depends on torch only (never on
``amped.autocast_mode`` or the layers above).
"""

from amped.scaling.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from amped.scaling.grad_scaler import GradScaler
from amped.scaling.stall import ScaleStallError
from amped.scaling.strategies import (
    Bounded,
    DynamicScale,
    Hysteresis,
    ScaleStrategy,
    StaticScale,
)

__all__ = [
    "Bounded",
    "CheckpointError",
    "DynamicScale",
    "GradScaler",
    "Hysteresis",
    "ScaleStallError",
    "ScaleStrategy",
    "StaticScale",
    "load_checkpoint",
    "save_checkpoint",
]
