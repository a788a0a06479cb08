"""Doctor layer: find where low precision breaks a model, and propose a verified fix.

``amped.doctor.diagnose(model, inputs, loss_fn, dtype=torch.float16)`` runs one training
step in float32 and in the low dtype and reports, per module and op, ranges,
inf/NaN counts, underflow and error against float32; the first op that produced a
non-finite value (forward or backward, with the user's source line); per-parameter
gradient underflow at the loss scale; and a fix (a Policy or a loss scale) it re-ran.
``amped.doctor.diagnose_fp8`` measures, per Linear layer, what an FP8 recipe costs and
names the layers to keep in bfloat16, with a policy it re-ran.
"""

from amped.doctor.diagnose import diagnose
from amped.doctor.fp8 import diagnose_fp8
from amped.doctor.fp8_report import CastStat, Fp8LayerStat, Fp8Report, Fp8Suggestion
from amped.doctor.gradients import GradientCheck, check_gradient, recommended_scale
from amped.doctor.report import Culprit, OpStat, Report, Suggestion

__all__ = [
    "CastStat",
    "Culprit",
    "Fp8LayerStat",
    "Fp8Report",
    "Fp8Suggestion",
    "GradientCheck",
    "OpStat",
    "Report",
    "Suggestion",
    "check_gradient",
    "diagnose",
    "diagnose_fp8",
    "recommended_scale",
]
