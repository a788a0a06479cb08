"""amped: mixed-precision training for PyTorch, in plain Python.

``amped.autocast`` and ``amped.GradScaler`` are drop-ins for ``torch.autocast`` and
``torch.amp.GradScaler``; :class:`amped.Policy` is autocast's op policy as data you can
read and change.
"""

from amped import doctor
from amped.autocast_mode import autocast, autocast_op, current_policy, custom_bwd, custom_fwd
from amped.fp8 import scaled_dot_product_attention
from amped.policy import Cast, ModuleRule, Policy
from amped.recipes import Recipe, TrainSetup, memory_report, monitor, prepare
from amped.scaling import GradScaler
from amped.tuning import tune

__version__ = "0.1.0"

__all__ = [
    "Cast",
    "GradScaler",
    "ModuleRule",
    "Policy",
    "Recipe",
    "TrainSetup",
    "__version__",
    "autocast",
    "autocast_op",
    "current_policy",
    "custom_bwd",
    "custom_fwd",
    "doctor",
    "memory_report",
    "monitor",
    "prepare",
    "scaled_dot_product_attention",
    "tune",
]
