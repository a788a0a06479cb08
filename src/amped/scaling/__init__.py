"""Scaling layer: ``GradScaler``, loss-scale strategies and their records.

Exported: what a training loop and a strategy of one's own need (the built-in
strategies are composed by ``GradScaler``'s keywords and handed back by
``GradScaler.strategy``; they stay importable here). Everything else
(argument checks, the state-dict layout, distributed agreement) is importable by
module path but not public API. Checkpoint files are :mod:`amped.checkpoint`'s.
Depends on torch only (never on ``amped.autocast_mode`` or the layers above).
"""

from __future__ import annotations

import warnings
from typing import Any

from amped.scaling.grad_scaler import GradScaler
from amped.scaling.stall import ScaleStallError

# Bounded, DynamicScale, Hysteresis and StaticScale are what GradScaler's keywords
# compose and `scaler.strategy` hands back: importable here for isinstance and
# equality, not in __all__.
from amped.scaling.strategies import Bounded as Bounded
from amped.scaling.strategies import DynamicScale as DynamicScale
from amped.scaling.strategies import Hysteresis as Hysteresis
from amped.scaling.strategies import ScaleStrategy
from amped.scaling.strategies import StaticScale as StaticScale

__all__ = ["GradScaler", "ScaleStallError", "ScaleStrategy"]

_MOVED = ("CheckpointError", "load_checkpoint", "save_checkpoint")
"""Checkpoint I/O, in :mod:`amped.checkpoint` now; importable from here for one release."""


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module 'amped.scaling' has no attribute {name!r}")
    from amped import checkpoint

    warnings.warn(
        f"amped.scaling.{name} is deprecated and will be removed in the next release; "
        f"use amped.checkpoint.{name}",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(checkpoint, name)
