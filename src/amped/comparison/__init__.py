"""Comparison layer: ``amped.compare``, the engine behind ``amped compare``.

One task trained once per precision recipe, fp32 first, from the same weights on the
same batches: step times (:mod:`~amped.comparison.timing`), training-state and peak
memory (:mod:`~amped.comparison.footprint`, :mod:`~amped.comparison.probe`), losses
and held-out metrics (:mod:`~amped.comparison.run`), all within one time budget
(:mod:`~amped.comparison.budget`, :mod:`~amped.comparison.plan`), and the findings
and ``results.json`` document drawn from them (:mod:`~amped.comparison.results`).
:func:`compare` returns that document as a :class:`CompareResult`; the CLI renders it.
Nothing here imports rich or matplotlib.
"""

from amped.comparison.api import compare
from amped.comparison.result import CompareResult as CompareResult  # the return type

__all__ = ["compare"]
