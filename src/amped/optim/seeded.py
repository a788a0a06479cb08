"""What amped's bf16-pure optimizers share: argument checks, the seeded random stream of
stochastic rounding and how it is saved, and the gradients they refuse.

:class:`~amped.optim.CompensatedSGD`, :class:`~amped.optim.CompensatedAdamW` and
:class:`~amped.optim.adamw8bit.CompensatedAdamW8bit` step differently (in chunks, or a
tensor at a time with 8-bit moments) but take their arguments, draw their random bits
and save them alike: :class:`SeededOptimizer` holds that, :func:`adamw_defaults` the
AdamW hyperparameters both AdamW variants check the same way.

The random stream: one ``torch.Generator`` per optimizer, seeded with ``seed`` and
created on the device of the first parameter that needs random bits.
``state_dict()`` adds ``"seed"`` and, once the generator exists, its state
(``"rng_state"``), so a resumed run draws the same bits; pickling keeps it too. Both
also stand in the first parameter group, where torch.distributed.checkpoint keeps them
(it drops an optimizer's other top-level keys).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from amped._internal.errors import received, type_error, value_error
from amped.optim.rounding import Compensation, require_bfloat16
from amped.optim.shards import with_random_state, without_random_state

__all__ = ["SeededOptimizer", "adamw_defaults", "check_number"]

COMPENSATIONS = ("kahan", "stochastic")
_LOW_DTYPES = (torch.bfloat16, torch.float16)


def check_number(name: str, value: float, low: float = 0.0, high: float | None = None) -> float:
    """``value`` as a float, if it is a number in ``[low, high)`` (``high=None``: no bound)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise type_error(f"{name} must be a number", name, value)
    if value < low or (high is not None and value >= high):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise value_error(f"{name} must be {bound}", name, value)
    return float(value)


def adamw_defaults(
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    maximize: bool,
    compensation: Compensation,
) -> dict[str, Any]:
    """The parameter-group defaults of an AdamW, each checked (see ``torch.optim.AdamW``)."""
    return dict(
        lr=check_number("lr", lr),
        betas=(
            check_number("betas[0]", betas[0], high=1.0),
            check_number("betas[1]", betas[1], high=1.0),
        ),
        eps=check_number("eps", eps),
        weight_decay=check_number("weight_decay", weight_decay),
        decoupled_weight_decay=bool(decoupled_weight_decay),
        maximize=bool(maximize),
        compensation=compensation,
    )


class SeededOptimizer(torch.optim.Optimizer):
    """A torch optimizer with a ``compensation`` default, a ``fused`` switch and a
    seeded random stream (see the module). Subclasses implement the step."""

    def __init__(
        self, params: Iterable[Any], defaults: dict[str, Any], seed: int, fused: bool | None
    ) -> None:
        if fused is not None and not isinstance(fused, bool):
            raise type_error("fused must be True, False or None (automatic)", "fused", fused)
        if defaults["compensation"] not in COMPENSATIONS:
            raise value_error(
                f"compensation must be one of {list(COMPENSATIONS)}",
                "compensation",
                defaults["compensation"],
            )
        super().__init__(params, defaults)
        self.seed = seed
        self.fused = fused
        self._generator: torch.Generator | None = None

    def _rng(self, device: torch.device) -> torch.Generator:
        if self._generator is None:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
        return self._generator

    def _refuse(self, param: torch.Tensor, group: dict) -> None:
        """Raise before any write for a gradient this optimizer cannot step: sparse, or
        a float16 weight under stochastic rounding (bfloat16 only)."""
        if param.grad is not None and param.grad.is_sparse:
            raise RuntimeError(
                f"{type(self).__name__} does not support sparse gradients. "
                + received("grad.layout", param.grad.layout)
            )
        if group["compensation"] == "stochastic" and param.dtype in _LOW_DTYPES:
            require_bfloat16(param.dtype)

    def state_dict(self) -> dict[str, Any]:
        """torch's layout, plus the seed and the random stream's state (``"rng_state"``)."""
        state = super().state_dict()
        state["seed"] = self.seed
        if self._generator is not None:
            state["rng_state"] = self._generator.get_state()
        return with_random_state(state)  # and in param_groups[0]: DCP keeps only those

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = without_random_state(state_dict)  # a copy, the random state on top
        rng_state = state_dict.pop("rng_state", None)
        self.seed = state_dict.pop("seed", self.seed)
        super().load_state_dict(state_dict)
        self._loaded(state_dict)
        self._generator = None
        if rng_state is not None:
            device = next(p.device for g in self.param_groups for p in g["params"])
            self._rng(device).set_state(rng_state)

    def _loaded(self, state_dict: dict[str, Any]) -> None:
        """Called by :meth:`load_state_dict` after torch's loading, with what it loaded."""

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["seed"] = self.seed
        state["fused"] = self.fused
        state["_generator"] = None
        state["_rng_state"] = None if self._generator is None else self._generator.get_state()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        rng_state = state.pop("_rng_state", None)
        # torch's load_state_dict calls this too, with the state and groups alone: the
        # optimizer's own fused then stays (it became None here before amped 0.3).
        if "fused" not in state and not hasattr(self, "fused"):
            state["fused"] = None  # pickled by amped < 0.2
        super().__setstate__(state)
        if rng_state is not None:
            device = next(p.device for g in self.param_groups for p in g["params"])
            self._rng(device).set_state(rng_state)
