"""Tuning layer: ``amped.tune`` chooses a precision per Linear layer (docs/tune.md).

- :mod:`.task`: the factory contract, on the library side;
- :mod:`.measure`: per-layer, per-format shadow measurements;
- :mod:`.attention`: per-role attention measurements and the roles' order of plans
  (``tune(..., attention=...)``);
- :mod:`.choose`: the estimate's order of plans, the first/last-N rule, the format
  speed table;
- :mod:`.verify`: paired training runs of a plan (an arm);
- :mod:`.search`: the verification rounds along the estimate's order;
- :mod:`.result`: :class:`TuneResult` and tuned.json; :mod:`.tuner`: :func:`tune`.

The plan itself (:class:`amped.recipes.PrecisionPlan`) lives in the recipes layer, with
:func:`amped.prepare`, which accepts it.
"""

from amped.tuning.result import TuneResult as TuneResult  # what tune returns
from amped.tuning.tuner import tune

__all__ = ["tune"]
