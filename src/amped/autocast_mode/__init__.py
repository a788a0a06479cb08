"""Autocast layer: the engine that applies a :class:`~amped.policy.Policy` op by op."""

from amped.autocast_mode.custom import autocast_op, custom_bwd, custom_fwd
from amped.autocast_mode.engine import current_path
from amped.autocast_mode.region import autocast
from amped.autocast_mode.state import Path as Path  # what current_path returns
from amped.autocast_mode.state import current_policy

__all__ = [
    "autocast",
    "autocast_op",
    "current_path",
    "current_policy",
    "custom_bwd",
    "custom_fwd",
]
