"""Scaling layer: ``GradScaler``, loss-scale strategies, records and checkpoints.

Depends on torch only (never on ``amped.autocast`` or the layers above).
"""

from amped.scaling.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from amped.scaling.checks import SCALE_FLOOR
from amped.scaling.config import StrategyConfig
from amped.scaling.grad_scaler import GradScaler
from amped.scaling.records import ScaleRecord
from amped.scaling.scaler_base import OptState
from amped.scaling.strategies import (
    Bounded,
    DynamicScale,
    GrowthFactors,
    Hysteresis,
    ScaleState,
    ScaleStrategy,
    StaticScale,
    make_strategy,
)

__all__ = [
    "SCALE_FLOOR",
    "Bounded",
    "CheckpointError",
    "DynamicScale",
    "GradScaler",
    "GrowthFactors",
    "Hysteresis",
    "OptState",
    "ScaleRecord",
    "ScaleState",
    "ScaleStrategy",
    "StaticScale",
    "StrategyConfig",
    "load_checkpoint",
    "make_strategy",
    "save_checkpoint",
]
