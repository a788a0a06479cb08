"""Doctor layer: find where low precision breaks a model, and propose a verified fix.

``amped.doctor.diagnose(model, inputs, loss_fn, dtype=torch.float16)`` runs one training
step in float32 and in the low dtype and reports, per module and op, ranges,
inf/NaN counts, underflow and error against float32; the first op that produced a
non-finite value (forward or backward, with the user's source line); per-parameter
gradient underflow at the loss scale; and a fix (a Policy or a loss scale) it re-ran.
"""

from amped.doctor.diagnose import diagnose
from amped.doctor.gradients import GradientCheck, check_gradient, recommended_scale
from amped.doctor.report import Culprit, OpStat, Report, Suggestion

__all__ = [
    "Culprit",
    "GradientCheck",
    "OpStat",
    "Report",
    "Suggestion",
    "check_gradient",
    "diagnose",
    "recommended_scale",
]
