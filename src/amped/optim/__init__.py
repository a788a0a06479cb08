"""Optimizers for low-precision weights: compensated updates, float32 masters, 8-bit state.

They depend on ``amped._internal`` alone (as ``torchao.optim`` depends on nothing of
the training recipes), so they can be used without :func:`amped.prepare`:

- :mod:`.compensated`: :class:`CompensatedAdamW`, :class:`CompensatedSGD`, stepping
  bfloat16 weights with Kahan compensation or stochastic rounding
  (:mod:`.rounding`, :mod:`.noise`, :mod:`.seeded`);
- :mod:`.adamw8bit`: :class:`CompensatedAdamW8bit`, the same AdamW with blockwise 8-bit moments
  (:mod:`.quantized_state`, :mod:`.adamw8bit_fused`, :mod:`.sharded_state`);
- :mod:`.master`: :class:`MasterWeightOptimizer`, float32 masters under any optimizer
  (:mod:`.master_step`, :mod:`.master_kernels`);
- :mod:`.in_backward`: :func:`step_in_backward`, each parameter stepped as its gradient
  is ready;
- shared pieces: :mod:`.fused` (one-pass kernels), :mod:`.chunks` and
  :mod:`.state_layout` (how parameters are grouped and their state laid out),
  :mod:`.shards` (FSDP2 shards).
"""

from amped.optim.adamw8bit import CompensatedAdamW8bit
from amped.optim.compensated import CompensatedAdamW, CompensatedSGD
from amped.optim.in_backward import step_in_backward
from amped.optim.master import MasterWeightOptimizer

__all__ = [
    "CompensatedAdamW",
    "CompensatedAdamW8bit",
    "CompensatedSGD",
    "MasterWeightOptimizer",
    "step_in_backward",
]
