"""Autocast layer: the engine that applies a :class:`~amped.policy.Policy` op by op."""

from amped.autocast_mode import (
    casting,
    compiling,
    custom,
    dispatch,
    freshness,
    mode,
    module_hooks,
    region,
    state,
    transparent,
)
from amped.autocast_mode.custom import autocast_op, custom_bwd, custom_fwd
from amped.autocast_mode.region import autocast, get_autocast_dtype, is_autocast_enabled
from amped.autocast_mode.state import current_policy, engine_always

__all__ = [
    "autocast",
    "autocast_op",
    "current_policy",
    "custom_bwd",
    "custom_fwd",
    "engine_always",
    "get_autocast_dtype",
    "is_autocast_enabled",
]

# Dynamo inlines these modules' functions when it traces user code, and never compiles
# them as frames of their own (see compiling.never_root_frames).
compiling.never_root_frames(
    casting,
    compiling,
    mode,
    region,
    state,
    transparent,
    custom,
    dispatch,
    module_hooks,
    freshness,
)
