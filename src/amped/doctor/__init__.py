"""Doctor layer: find where low precision breaks a model, and propose a verified fix.

``amped.doctor.diagnose(model, inputs, loss_fn, dtype=torch.float16)`` runs one training
step in float32 and in the low dtype and reports, per module and op, ranges,
inf/NaN counts, underflow and error against float32; the first op that produced a
non-finite value (forward or backward, with the user's source line); per-parameter
gradient underflow at the loss scale; and a fix (a Policy or a loss scale) it re-ran.
``amped.doctor.diagnose_fp8`` measures, per Linear layer, what an FP8 recipe costs and
names the layers to keep in bfloat16, with a policy it re-ran. Importing it loads no
plotting library: the HTML page and plot are the CLI's (:mod:`amped.cli.doctor.html`).
"""

from amped.doctor.diagnose import diagnose
from amped.doctor.fp8 import diagnose_fp8
from amped.doctor.replay import replay

# The two checks, the reports they return and the fixes they propose. The records inside
# a report (OpStat, Culprit, GradientCheck, Fp8LayerStat, CastStat) are reached through
# it, and live in amped.doctor.report, .fp8_report and .gradients.
# replay reruns a recorded step (amped.monitor(setup, record=DIR)); its ReplayResult is
# amped.doctor.replay.ReplayResult.
__all__ = ["diagnose", "diagnose_fp8", "replay"]
