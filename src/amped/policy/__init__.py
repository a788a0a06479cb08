"""Policy layer: what autocast does with each op, as data. Depends on torch only."""

from amped.policy.ops import TORCH_OP_TABLES, Cast, registered_autocast_ops, torch_default_rules
from amped.policy.policy import LOW_DTYPES, ModuleRule, OpKey, Policy, Precision, op_label

__all__ = [
    "LOW_DTYPES",
    "TORCH_OP_TABLES",
    "Cast",
    "ModuleRule",
    "OpKey",
    "Policy",
    "Precision",
    "op_label",
    "registered_autocast_ops",
    "torch_default_rules",
]
