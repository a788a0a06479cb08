"""What one training step of a model ran, per layer and GEMM role, read by hooks that
change no number the backend computes.

- **Module hooks** on each layer the plan names: its input (forward pre-hook), output
  (forward hook), grad_output (backward pre-hook) and grad_input (backward hook); its
  weight's gradient is read after the step. They attribute everything in between to
  the layer, and give the high-precision tensors the reference casts start from.
- **A dispatch mode** sees every GEMM op (``mm``, ``addmm``, ``bmm``) below autograd,
  a tensor subclass's before its own dispatch: torchao's ``Float8TrainingTensor`` and
  ``MXTensor`` operands are read there
  (:func:`amped.verification.operands.from_gemm_arg`), as are the plain operands of a
  GEMM that ran in high precision. Inside a layer's backward, a GEMM whose output has
  the input's shape is grad_input's, one with the weight's is grad_weight's.
- **amped's own layers** report each GEMM's casts to an observer
  (:func:`amped.lowp.health.record_gemm`); the one set here takes their operands,
  which replace what the mode read (the emulated GEMM multiplies values, not casts).

Under a dispatch mode amped's casts run eagerly rather than compiled: the same bits
(:mod:`amped.lowp.float8.compiled_cast`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from amped._internal import torch_compat
from amped.lowp.conv1d import is_conv1d
from amped.lowp.health import Operand as HealthOperand
from amped.verification.operands import Operand, from_amped, from_gemm_arg, transposed

__all__ = ["Gemm", "LayerRecord", "capture", "eager_casts"]

_aten = torch.ops.aten
_GEMMS = {_aten.mm.default: (0, 1), _aten.addmm.default: (1, 2), _aten.bmm.default: (0, 1)}


@dataclass
class Gemm:
    """One GEMM as it ran: ``A @ B.T`` (:mod:`amped.verification.operands`)."""

    a: Operand
    b: Operand
    source: str  # "layer" (amped's observer) or "dispatch"


@dataclass
class LayerRecord:
    """What one layer saw and computed during the step (tensors detached)."""

    name: str
    module: torch.nn.Module
    x: torch.Tensor | None = None  # [tokens, in]
    output: torch.Tensor | None = None  # [tokens, out]
    grad_output: torch.Tensor | None = None  # [tokens, out]
    grad_input: torch.Tensor | None = None  # [tokens, in]
    grad_weight: torch.Tensor | None = None  # [out, in]
    rng: tuple[int, int] | None = None
    gemms: dict[str, Gemm] = field(default_factory=dict)
    phase: str = "forward"

    @property
    def weight(self) -> torch.Tensor:
        weight = _weight(self.module).detach()
        return weight.t() if _transposed(self.module) else weight

    @property
    def bias(self) -> torch.Tensor | None:
        bias = getattr(self.module, "bias", None)
        return None if bias is None else bias.detach()


def _weight(module: torch.nn.Module) -> torch.Tensor:
    weight = module.weight
    assert isinstance(weight, torch.Tensor)  # a Linear or Conv1D
    return weight


def _transposed(module: torch.nn.Module) -> bool:
    """A transformers Conv1D (converted or not) stores its weight ``[in, out]``."""
    return bool(getattr(module, "weight_transposed", False)) or is_conv1d(module)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1, t.shape[-1])


class _GemmMode(torch_compat.torch_dispatch_mode()):  # type: ignore[misc]
    """Hands every GEMM op run inside a layer to :meth:`_Capture.on_gemm`."""

    def __init__(self, owner: _Capture) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.owner.current is not None and func in _GEMMS:
            i, j = _GEMMS[func]
            self.owner.on_gemm(args[i], args[j], out)
        return out


class _Passthrough(torch_compat.torch_dispatch_mode()):  # type: ignore[misc]
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def eager_casts() -> contextlib.AbstractContextManager[Any]:
    """A block in which amped's casts run eagerly, as they do under :func:`capture`:
    under any dispatch mode (:mod:`amped.lowp.float8.compiled_cast`). One step's
    reference casts never earn back a kernel's compile (seconds per shape)."""
    return _Passthrough()


class _Capture:
    """The hooks' shared state: the layer running now and every layer's record."""

    def __init__(self, records: dict[str, LayerRecord]) -> None:
        self.records = records
        self.by_module = {id(r.module): r for r in records.values()}
        self.current: LayerRecord | None = None

    # amped's layers: lowp.health.record_gemm calls this (fp8_observer)
    sampling = False

    def observe(self, *args: Any) -> None:  # the GemmObserver protocol; unused
        return None

    def capture_gemm(
        self,
        layer: torch.nn.Module,
        role: str,
        output: torch.Tensor,
        operands: Mapping[str, HealthOperand],
    ) -> None:
        record = self.by_module.get(id(layer))
        if record is None:
            return
        (a_high, a_low), (b_high, b_low) = operands.values()
        a, b = from_amped(a_high, a_low), from_amped(b_high, b_low)
        if hasattr(layer, "float8_config") and role != "forward":
            # lowp's Float8Linear passes grad_input's weight [out, in] and grad_weight's
            # operands [tokens, .]: the GEMM is A @ B there (its block layers pass A, B.T)
            a = transposed(a) if role == "grad_weight" else a
            b = transposed(b)
        record.gemms[role] = Gemm(a, b, "layer")

    def on_gemm(self, a: Any, b: Any, out: torch.Tensor) -> None:
        record = self.current
        assert record is not None  # checked by the mode
        first, second = from_gemm_arg(a, False), from_gemm_arg(b, True)
        if first is None or second is None or out.dim() != 2:
            return
        role = self._role(record, out)
        if role is None or role in record.gemms:
            return
        if role == "grad_weight" and _computed_transposed(record, out):
            first, second = second, first  # x.T @ grad_output: grad_weight's transpose
        record.gemms[role] = Gemm(first, second, "dispatch")

    @staticmethod
    def _role(record: LayerRecord, out: torch.Tensor) -> str | None:
        if record.phase == "forward":
            return "forward"
        x = record.x
        if x is None:
            return None
        tokens, d_in = x.shape
        d_out = record.weight.shape[0]
        if tuple(out.shape) == (tokens, d_in) and "grad_input" not in record.gemms:
            return "grad_input"
        if tuple(out.shape) in ((d_out, d_in), (d_in, d_out)):
            return "grad_weight"
        return None


def _computed_transposed(record: LayerRecord, out: torch.Tensor) -> bool:
    """Whether a grad_weight GEMM's output is ``[in, out]`` (a square weight's is read
    as ``grad_output.T @ x``, torch's own order)."""
    d_out, d_in = record.weight.shape
    return d_in != d_out and tuple(out.shape) == (d_in, d_out)


def _hooks(state: _Capture, record: LayerRecord) -> list[Any]:
    module = record.module

    def pre_forward(_: Any, args: tuple[Any, ...]) -> None:
        if args and isinstance(args[0], torch.Tensor):
            record.x = _flat(args[0])
        record.phase = "forward"
        state.current = record

    def post_forward(_: Any, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor):
            record.output = _flat(output)
        state.current = None

    def pre_backward(_: Any, grad_output: tuple[Any, ...]) -> None:
        if grad_output and grad_output[0] is not None:
            record.grad_output = _flat(grad_output[0])
        rng = getattr(module, "fp8_rng", None)
        if isinstance(rng, torch.Tensor):
            seed, draws = (int(v) for v in rng.tolist())
            record.rng = (seed, draws)
        record.phase = "backward"
        state.current = record

    def post_backward(_: Any, grad_input: tuple[Any, ...], grad_output: Any) -> None:
        if grad_input and grad_input[0] is not None:
            record.grad_input = _flat(grad_input[0])
            state.current = None  # else the layer's own backward has not run yet

    return [
        module.register_forward_pre_hook(pre_forward),
        module.register_forward_hook(post_forward),
        module.register_full_backward_pre_hook(pre_backward),
        module.register_full_backward_hook(post_backward),
    ]


@contextlib.contextmanager
def capture(model: torch.nn.Module, names: list[str]) -> Iterator[dict[str, LayerRecord]]:
    """Record the layers ``names`` of ``model`` over the block (one forward and backward),
    then their weights' gradients (read at the end: clear them before the step)."""
    records = {name: LayerRecord(name, model.get_submodule(name)) for name in names}
    state = _Capture(records)
    handles: list[Any] = []
    observed: list[tuple[torch.nn.Module, Any]] = []
    for record in records.values():
        handles += _hooks(state, record)
        if hasattr(record.module, "float8_config") or hasattr(record.module, "block_config"):
            observed.append((record.module, getattr(record.module, "fp8_observer", None)))
            record.module.fp8_observer = state  # type: ignore[assignment]
    try:
        with _GemmMode(state), warnings.catch_warnings():
            # a layer whose input needs no gradient: its backward hook fires early,
            # which post_backward allows for
            warnings.filterwarnings("ignore", "Full backward hook is firing")
            yield records
        for record in records.values():
            grad = _weight(record.module).grad
            if grad is not None:
                record.grad_weight = (grad.t() if _transposed(record.module) else grad).detach()
    finally:
        for handle in handles:
            handle.remove()
        for module, previous in observed:
            module.fp8_observer = previous
