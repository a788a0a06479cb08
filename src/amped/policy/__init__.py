"""Policy layer: what autocast does with each op, as data. Depends on torch only.

Exported: the policy value and its parts. torch's op tables
(:mod:`amped.policy.ops`) and the helpers are importable by module path.
"""

from amped.policy.ops import Cast
from amped.policy.policy import ModuleRule, Policy

__all__ = ["Cast", "ModuleRule", "Policy"]
