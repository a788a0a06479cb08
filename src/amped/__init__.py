"""amped: mixed-precision training for PyTorch, in plain Python.

``amped.autocast`` and ``amped.GradScaler`` are drop-ins for ``torch.autocast`` and
``torch.amp.GradScaler``; :class:`amped.Policy` is autocast's op policy as data you can
read and change. :func:`amped.compare` measures what each precision recipe buys a model,
and :func:`amped.tune` chooses a precision per layer; :func:`amped.verify` checks a
low-precision step of any backend against amped's exact reference, and
:func:`amped.export` writes the trained model in the inference format of its recipe.
"""

from amped import doctor
from amped._internal.version import __version__
from amped.autocast_mode import autocast, autocast_op, current_policy, custom_bwd, custom_fwd
from amped.comparison import compare
from amped.exporting import export
from amped.lowp import scaled_dot_product_attention
from amped.policy import Cast, ModuleRule, Policy
from amped.recipes import Recipe, memory_report, monitor, prepare
from amped.recipes import TrainSetup as TrainSetup  # what prepare returns
from amped.scaling import GradScaler
from amped.tuning import tune
from amped.verification import verify

__all__ = [
    "Cast",
    "GradScaler",
    "ModuleRule",
    "Policy",
    "Recipe",
    "__version__",
    "autocast",
    "autocast_op",
    "compare",
    "current_policy",
    "custom_bwd",
    "custom_fwd",
    "doctor",
    "export",
    "memory_report",
    "monitor",
    "prepare",
    "scaled_dot_product_attention",
    "tune",
    "verify",
]
