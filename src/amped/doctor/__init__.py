"""Doctor layer: find where low precision breaks a model, and propose a verified fix.

``amped.doctor.diagnose(model, inputs, loss_fn, dtype=torch.float16)`` runs one training
step in float32 and in the low dtype and reports, per module and op, ranges,
inf/NaN counts, underflow and error against float32; the first op that produced a
non-finite value (forward or backward, with the user's source line); per-parameter
gradient underflow at the loss scale; and a fix (a Policy or a loss scale) it re-ran.
``amped.doctor.diagnose_low_precision`` measures, per Linear layer, what an FP8 or block
recipe (MXFP8, MXFP4, NVFP4) costs and names the layers to keep in bfloat16, with a policy
it re-ran. Importing it loads no plotting library: the HTML page and plot are the CLI's
(:mod:`amped.cli.doctor.html`).
"""

import warnings
from typing import Any

from amped.doctor.diagnose import diagnose
from amped.doctor.lowp import diagnose_low_precision
from amped.doctor.replay import replay

# The two checks, the reports they return and the fixes they propose. The records inside
# a report (OpStat, Culprit, GradientCheck, LowPrecisionLayerStat, CastStat) are reached
# through it, and live in amped.doctor.report, .lowp_report and .gradients.
# replay reruns a recorded step (amped.monitor(setup, record=DIR)); its ReplayResult is
# amped.doctor.replay.ReplayResult.
__all__ = ["diagnose", "diagnose_low_precision", "replay"]


# rewrite: keep-start (the old spelling, deprecated)
def __getattr__(name: str) -> Any:
    if name != "diagnose_fp8":
        raise AttributeError(f"module 'amped.doctor' has no attribute {name!r}")
    warnings.warn(
        "amped.doctor.diagnose_fp8 is deprecated and will be removed in the next release; "
        "use amped.doctor.diagnose_low_precision",
        DeprecationWarning,
        stacklevel=2,
    )
    return diagnose_low_precision


# rewrite: keep-end
