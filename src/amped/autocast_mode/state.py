"""The engine's per-thread state: one :class:`EngineState` per thread owns every store
the engine keeps (torch's own autocast state stays in torch's thread-local C++ state).
It imports nothing of the engine's logic; ``dispatch``, ``module_hooks`` and ``engine``
read it here.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from amped.autocast_mode.casting import WeightCache
from amped.policy import Policy

__all__ = [
    "STATE",
    "EngineState",
    "Path",
    "Region",
    "current_policy",
    "innermost_policies",
    "kept",
]

T = TypeVar("T")


class Path(enum.Enum):
    """How a region applies its policy, decided once when it is entered (the table of
    paths, what takes each and its cost: docs/engine.md).

    ``TORCH``: torch's C++ autocast. ``KERNELS``: that, plus amped's kernels at torch's
    Autocast dispatch keys for the ops whose rule differs. ``MODE``: amped's
    ``TorchFunctionMode`` applies every rule.
    """

    TORCH = "torch"
    KERNELS = "kernels"
    MODE = "mode"


@dataclasses.dataclass(slots=True, eq=False)
class Region:
    """One open amped region: its path, and the torch state it found on entry.

    Removed by identity (a region held across a ``yield`` may exit before one opened
    after it): what it changed is handed to the next region above it on its device.
    """

    device_type: str
    policy: Policy | None  # None: a disabled region, or a device type without policies
    enabled: bool
    dtype: torch.dtype
    cache_enabled: bool
    path: Path = Path.TORCH
    unplain: bool = False  # a policy other than torch's rules alone (engine.py)
    depth: int = 0  # the torch-function stack's depth on entry
    # (autocast enabled, autocast dtype) of its device, and the cache setting, on entry
    saved: tuple[bool, torch.dtype, bool] = (False, torch.float32, True)


class EngineState(threading.local):
    """Everything the engine keeps for one thread."""

    def __init__(self) -> None:
        self.regions: list[Region] = []  # open regions, in entry order
        self.mode: Any = None  # the AutocastMode on the stack while a MODE region is open
        self.spare_mode: Any = None  # reused region after region
        self.runner: Any = None  # never pushed: runs @autocast_op rules off the mode
        self.kernels: dict[str, Any] = {}  # device type -> active fast-path kernel rules
        self.ruled: dict[str, Policy] = {}  # device type -> innermost policy with module rules
        self.cache = WeightCache()  # low-precision weight copies, every path
        self.forced: Path | None = None  # forced_path: the doctor, tests, benchmarks
        self.torch_alongside = True  # torch's C++ autocast may run inside MODE regions
        self.guard_mark = False  # autocast on for compiling.GUARD_DEVICE_TYPE (for Dynamo)
        # Policies a compile on this thread traced, and the Dynamo reset they date from
        # (compiling.traced): later regions of these on this thread take MODE.
        self.traced: set[Policy] = set()
        self.traced_since = 0
        self.aside = False  # compiling.outside_regions: a compile here is not the regions'
        self.frames: list[tuple[torch.nn.Module, Any]] = []  # module rules' open modules
        self.names: dict[int, str] = {}  # module id -> qualified name (name rules)
        # an "fp32" module whose keyword inputs are cast next: the module, the device
        # types to cast on, and its mark (module_hooks)
        self.keywords: tuple[torch.nn.Module, list[str], Any, bool] | None = None


STATE = EngineState()


def kept(policy: Policy, key: object, compute: Callable[[], T]) -> T:
    """``compute()``, computed once and kept with ``policy`` (a policy is immutable):
    every table the engine derives from a policy is built this one way."""
    cache = policy._engine_cache
    if key not in cache:
        cache[key] = compute()
    return cache[key]


def innermost_policies(regions: list[Region]) -> dict[str, Policy]:
    """Device type -> the policy of the innermost region with one."""
    if len(regions) == 1 and regions[0].policy is not None:  # the usual case
        return {regions[0].device_type: regions[0].policy}
    return {r.device_type: r.policy for r in regions if r.policy is not None}


def current_policy(device_type: str) -> Policy | None:
    """The policy of the innermost enabled amped region for ``device_type`` on this thread."""
    return innermost_policies(STATE.regions).get(device_type)
