"""The fused master-weight step: torch's Adam, AdamW or SGD on float32 masters, one kernel a chunk.

:class:`~amped.optim.master.MasterWeightOptimizer` steps its inner optimizer on float32
masters in five passes over memory (each low-precision gradient to float32, unscale,
the optimizer's own ops one by one, each master rounded into the model). For the
optimizers torch runs as plain per-tensor loops, :class:`FusedMasterStep` does the same
arithmetic in one compiled kernel per chunk of parameters
(:mod:`amped.optim.master_kernels` says which roundings it keeps): it reads each
low-precision gradient once, unscales it, updates the master and the optimizer's state
in place and writes the model's weight. The optimizer's state stays torch's, in torch's
layout (``state[master]["exp_avg"]``, a float32 tensor ``"step"``, ...), so the eager
step, ``state_dict`` and checkpoints see no difference.

Chunks (:mod:`amped.optim.chunks`): the parameters of a group that share a dtype and
a step count (Adam) or a first step (SGD) are cut into chunks, in parameter order.
Masters, the model's lowered weights and new state are laid out as views of one
tensor per kind (:func:`lay_out_data`, :mod:`amped.optim.state_layout`), so that a
chunk's column is one slice of memory the kernel reads and writes where it lies;
gradients (autograd's own tensors) are gathered into a row kept with the chunk, 2
bytes per low-precision parameter.

What is fused: every parameter with a gradient, under ``torch.optim.Adam``, ``AdamW``
and ``SGD`` without ``amsgrad``, ``capturable``, ``differentiable``, ``fused=True``
or a tensor learning rate (:func:`unsupported` names the reason), outside
``torch.compile`` and Python modes. Gradients come from the low-precision parameters,
or from the masters where :meth:`~amped.optim.master.MasterWeightOptimizer.grads_to_masters`
put them (clipping needs them there, unscaled). The inner optimizer's ``step`` is not
called: step hooks registered on it do not run (register them on the
``MasterWeightOptimizer``, whose ``step`` runs them); LR schedulers built on it see it
stepped.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from amped._internal.torch_compat import foreach_copy_, mark_stepped, python_mode_active
from amped.optim import fused, master_kernels, state_layout
from amped.optim.chunks import Chunk, Plan

__all__ = ["FusedMasterStep", "lay_out_data", "unsupported"]

_SUPPORTED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
_SGD_KEYS: tuple[str, ...] = ("momentum_buffer",)
_ADAM_KEYS: tuple[str, ...] = ("exp_avg", "exp_avg_sq")
# Chunks: at most 2**22 elements (a gathered gradient row of 8 MiB in bfloat16); a
# parameter of 2**20 elements or more is a chunk of its own, with nothing to gather
# (the trade-off measured for the compensated optimizers' fused step).
_MOST = 1 << 22
_ALONE = 1 << 20
_GRAD, _MASTER, _LOW = 0, 1, 2  # gather slots; state columns follow
_WHO = "amped's master-weight optimizer"


def unsupported(optimizer: torch.optim.Optimizer) -> str | None:
    """Why the fused step cannot run ``optimizer``'s algorithm, or None if it can."""
    kind = type(optimizer)
    if kind not in _SUPPORTED:
        return (
            f"the fused master-weight step runs torch.optim.Adam, AdamW and SGD, not "
            f"{kind.__name__}"
        )
    for group in optimizer.param_groups:
        for option in ("amsgrad", "capturable", "differentiable", "fused"):
            if group.get(option):
                return f"the fused master-weight step does not run {kind.__name__}({option}=True)"
        values = (group["lr"], *group.get("betas", ()), group["weight_decay"])
        if any(isinstance(value, torch.Tensor) for value in values):
            return (
                f"the fused master-weight step takes {kind.__name__}'s lr, betas and "
                "weight_decay as Python numbers, not tensors"
            )
    return None


def lay_out_data(tensors: Sequence[torch.Tensor]) -> None:
    """Make ``tensors`` (parameters or masters, in order) views of one new tensor per
    device and dtype, values kept, by swapping their ``.data`` (identity kept, as
    ``Module.to`` does). Only plain, contiguous tensors are moved."""
    batches: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        if state_layout.plain(tensor) and tensor.is_contiguous():
            batches.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    with torch.no_grad():
        for (device, dtype), members in batches.items():
            whole = torch.empty(sum(t.numel() for t in members), dtype=dtype, device=device)
            views = [
                part.view(t.shape)
                for part, t in zip(whole.split([t.numel() for t in members]), members, strict=True)
            ]
            foreach_copy_(views, [t.detach() for t in members])
            for tensor, view in zip(members, views, strict=True):
                tensor.data = view


class FusedMasterStep:
    """The fused step of one :class:`~amped.optim.master.MasterWeightOptimizer`."""

    def __init__(self, optimizer: torch.optim.Optimizer, strict: bool) -> None:
        self.optimizer = optimizer
        self.strict = strict  # fused=True: a failed compile raises
        self._plan = Plan(0, 0, rows=False, alone=_ALONE)
        self._dummies: dict[torch.device, torch.Tensor] = {}

    @property
    def keys(self) -> tuple[str, ...]:
        return _SGD_KEYS if isinstance(self.optimizer, torch.optim.SGD) else _ADAM_KEYS

    def can_run(self, params: list[torch.Tensor]) -> bool:
        """Whether this step can be fused (checked before anything is written)."""
        if torch.compiler.is_compiling() or python_mode_active():
            return False  # under a user's compile Dynamo fuses the eager step itself
        if unsupported(self.optimizer) is not None:
            return False
        for param in params:
            if not state_layout.plain(param) or param.is_complex():
                return False
            reason = fused.available(param.device.type)
            if reason is not None:
                if self.strict:
                    raise RuntimeError(
                        f"fused=True cannot run here: {reason}. Pass fused=None (the eager "
                        "step where the fused one cannot run) or fused=False"
                    )
                return False
        return True

    @torch.no_grad()
    def step(
        self,
        grads: dict[torch.Tensor, torch.Tensor],
        lows: dict[torch.Tensor, torch.Tensor],
        inv_scale: torch.Tensor | None,
    ) -> None:
        """Step every parameter in ``grads`` (stepped tensor -> its gradient); ``lows``
        maps a master to the model's low-precision parameter to write. ``inv_scale``
        (float32, 0-d): multiply the gradients by it first."""
        sgd = isinstance(self.optimizer, torch.optim.SGD)
        state = self.optimizer.state
        groups, requests, fresh = [], [], set()
        for group in self.optimizer.param_groups:
            params = [p for p in group["params"] if p in grads]
            for param in params:
                entry = state[param]
                if sgd:
                    if group["momentum"] != 0 and "momentum_buffer" not in entry:
                        fresh.add(param)
                elif "step" not in entry:
                    entry["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
                    fresh.add(param)
            groups += _split(
                group, params, lambda p: _signature(state[p], p in fresh, p, grads, lows)
            )
        for _, params in groups:  # new state in chunk order: each chunk's is one slice
            for param in params:
                if param in fresh:
                    requests += [(param, key, not sgd) for key in self.keys]
        state_layout.allocate(state, requests)
        if not sgd:
            for _, params in groups:
                for param in params:
                    state[param]["step"] += 1
        splittable = self._splittable_in(grads, lows)
        for group, chunk in self._plan.chunks(groups, _MOST, splittable):
            first = sgd and chunk.owners[0] in fresh
            self._step_chunk(chunk, group, grads, lows, inv_scale, first)
        mark_stepped(self.optimizer)  # for an LR scheduler built on the inner optimizer

    def _splittable_in(
        self, grads: dict[torch.Tensor, torch.Tensor], lows: dict[torch.Tensor, torch.Tensor]
    ) -> Callable[[torch.Tensor], bool]:
        def splittable(param: torch.Tensor) -> bool:
            low = lows.get(param)
            tensors = [param, grads[param], *self.optimizer.state[param].values()]
            tensors += [low] if low is not None else []
            return all(
                t.is_contiguous() for t in tensors if isinstance(t, torch.Tensor) and t.dim()
            )

        return splittable

    def _step_chunk(
        self,
        chunk: Chunk,
        group: dict[str, Any],
        grads: dict[torch.Tensor, torch.Tensor],
        lows: dict[torch.Tensor, torch.Tensor],
        inv_scale: torch.Tensor | None,
        first: bool,
    ) -> None:
        owners = chunk.owners
        states = [self.optimizer.state[p] for p in owners]
        write_low = owners[0] in lows
        columns: list[tuple[list[torch.Tensor], bool, bool]] = [  # tensors, read, written
            ([grads[p] for p in owners], True, False),
            (owners, True, True),
            ([lows[p] for p in owners] if write_low else [], False, True),
        ]
        momentum = not isinstance(self.optimizer, torch.optim.SGD) or group["momentum"] != 0
        for key in self.keys if momentum else ():
            columns.append(([s[key] for s in states], not first, True))
        rows, back = [], []
        for slot, (tensors, read, written) in enumerate(columns):
            if not tensors:
                rows.append(self._dummy(chunk.device))
                continue
            parts = chunk.take(tensors)
            row = state_layout.flat(parts) if slot <= _LOW else chunk.flat(slot, parts)
            if row is None:
                row, views = chunk.gather_row(slot, parts[0].dtype)
                if read:
                    foreach_copy_(views, parts)
                if written:
                    back.append((parts, views))
            rows.append(row)
        if not momentum:
            rows.append(self._dummy(chunk.device))
        kernel, scalars, flags = self._kernel(group, states[0], write_low, first, momentum)
        all_flags = (inv_scale is not None, group["maximize"], *flags)
        values = torch.tensor([1.0, *scalars], dtype=torch.float32, device=chunk.device)
        if inv_scale is not None:
            values[:1].copy_(inv_scale)
        # (grad, master, *state, low, scalars): SGD has one state row, Adam two
        args = (rows[_GRAD], rows[_MASTER], *rows[_LOW + 1 :], rows[_LOW], values)
        if not fused.run(kernel, chunk.device.type, self.strict, args, all_flags, who=_WHO):
            kernel(
                *args, *all_flags
            )  # eagerly: the same ops, each fused multiply-add rounded twice
        for parts, views in back:
            foreach_copy_(parts, views)

    def _kernel(
        self,
        group: dict[str, Any],
        state: dict[str, Any],
        write_low: bool,
        first: bool,
        momentum: bool,
    ) -> tuple[Callable[..., None], list[float], tuple[bool, ...]]:
        """The kernel, its scalars after the inverse scale, and its flags after
        ``unscale`` and ``maximize``; scalars in Python floats first, as torch computes
        them, then rounded to float32 once, as torch's CPU kernels take a Python scalar."""
        lr, decay = group["lr"], group["weight_decay"]
        if isinstance(self.optimizer, torch.optim.SGD):
            scalars = [decay, group["momentum"], 1 - group["dampening"], -lr]
            flags = (decay != 0, momentum, first, group["nesterov"], write_low)
            return master_kernels.sgd, scalars, flags
        beta1, beta2 = group["betas"]
        count = state["step"].item()  # a CPU tensor, as torch keeps it: no device sync
        decoupled = group.get(
            "decoupled_weight_decay", isinstance(self.optimizer, torch.optim.AdamW)
        )
        correction1, correction2 = 1 - beta1**count, 1 - beta2**count
        scalars = [decay, 1 - lr * decay, 1 - beta1, beta2, 1 - beta2]
        scalars += [correction2**0.5, group["eps"], -(lr / correction1)]
        return (
            master_kernels.adam,
            scalars,
            (decay != 0 and not decoupled, decay != 0 and decoupled, write_low),
        )

    def _dummy(self, device: torch.device) -> torch.Tensor:
        """An empty float32 tensor for a kernel argument a flag leaves unused."""
        dummy = self._dummies.get(device)
        if dummy is None:
            dummy = self._dummies[device] = torch.empty(0, device=device)
        return dummy


def _scalar_dtype() -> torch.dtype:
    """The dtype torch's Adam keeps its step count in (as ``_get_scalar_dtype`` in
    ``torch.optim.optimizer``)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _signature(
    entry: dict[str, Any],
    first: bool,
    param: torch.Tensor,
    grads: dict[torch.Tensor, torch.Tensor],
    lows: dict[torch.Tensor, torch.Tensor],
) -> tuple[Any, ...]:
    """What the parameters of one chunk share: their step count (Adam) or first step
    (SGD), the gradient's dtype, and the low-precision weight's (None: a float32 one)."""
    step = entry.get("step")
    count = None if step is None else step.item()
    low = lows.get(param)
    return (count, first, grads[param].dtype, None if low is None else low.dtype)


def _split(
    group: dict[str, Any], params: list[torch.Tensor], key: Callable[[torch.Tensor], Any]
) -> list[tuple[dict[str, Any], list[torch.Tensor]]]:
    """``params`` in runs of one ``key``, each kept in parameter order."""
    runs: dict[Any, list[torch.Tensor]] = {}
    for param in params:
        runs.setdefault(key(param), []).append(param)
    return [(group, members) for members in runs.values()]


def warn_unfused(reason: str) -> None:
    """The one warning of a MasterWeightOptimizer that keeps the unfused step."""
    warnings.warn(
        f"amped's master weights keep the unfused step (five passes over memory) for this "
        f"optimizer: {reason}. Results are the same; pass fused=False to silence this",
        RuntimeWarning,
        stacklevel=4,
    )
