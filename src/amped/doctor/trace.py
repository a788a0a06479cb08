"""Recording every value-producing op of a forward pass, with its module and source line.

A :class:`Tracer` is a TorchFunctionMode pushed *below* autocast's mode: autocast
casts an op's inputs and calls it, and the tracer sees that call with the casts
already made, so it records what the op really computed. Python composites are run
transparently (as the engine does), so the tracer sees their inner ops too. Module
paths come from global module hooks while a trace is open.
"""

from __future__ import annotations

import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.modules import module as nn_module
from torch.overrides import TorchFunctionMode

from amped._internal.source import user_source
from amped._internal.trees import iter_tensors
from amped.autocast_mode import transparent

__all__ = ["OpCall", "Tracer", "float_tensors", "user_source"]

Op = Callable[..., Any]
Args = tuple[Any, ...]

# Calls that only reshape, view, copy or describe: they never create a new value range.
_NOT_COMPUTE = frozenset(
    [
        "view",
        "view_as",
        "reshape",
        "reshape_as",
        "flatten",
        "unflatten",
        "squeeze",
        "unsqueeze",
        "transpose",
        "t",
        "permute",
        "contiguous",
        "expand",
        "expand_as",
        "__getitem__",
        "narrow",
        "select",
        "slice",
        "split",
        "chunk",
        "unbind",
        "split_with_sizes",
        "detach",
        "clone",
        "to",
        "float",
        "half",
        "bfloat16",
        "double",
        "type",
        "type_as",
        "__get__",
        "size",
        "dim",
        "numel",
        "stride",
        "is_floating_point",
        "item",
        "tolist",
        "cpu",
        "cuda",
        "requires_grad_",
        "movedim",
        "as_strided",
        "repeat",
        "masked_fill",
        "index_select",
        "gather",
        "stack",
        "cat",
        "tensor_split",
        "new_zeros",
        "new_ones",
        "new_empty",
        "new_full",
        "zeros",
        "ones",
        "empty",
        "full",
        "arange",
        "zeros_like",
        "ones_like",
        "empty_like",
        "full_like",
        "tensor",
        "as_tensor",
        "triu",
        "tril",
    ]
)


@dataclass
class OpCall:
    """One recorded op call: where it ran, what it returned, and what fed it."""

    index: int
    module: str  # qualified name of the innermost module ("" for the root)
    op: str  # the function's name ("linear", "exp", "softmax")
    occurrence: int  # how many times (module, op) ran before this call
    output: torch.Tensor  # detached output (first floating tensor returned)
    inputs_finite: bool  # all floating tensor inputs were finite
    producers: list[int] = field(default_factory=list)  # indices of calls that made its inputs
    source: str | None = None  # user file:line that led here (filled for culprits only)
    stack: traceback.StackSummary | None = None
    live_output: torch.Tensor | None = None  # the non-detached output, for backward hooks

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.module, self.op, self.occurrence)


def float_tensors(value: Any) -> list[torch.Tensor]:
    """The floating-point tensors inside ``value`` (nested tuples, lists, dicts), in order."""
    return [t for t in iter_tensors(value) if t.is_floating_point()]


class Tracer(TorchFunctionMode):
    """Records :class:`OpCall` s for every value-producing op while active."""

    def __init__(self, root: torch.nn.Module, keep_live: bool = False) -> None:
        super().__init__()
        self.calls: list[OpCall] = []
        self._names = {id(m): name for name, m in root.named_modules()}
        self._modules: list[str] = []
        self._counts: dict[tuple[str, str], int] = {}
        self._producer: dict[int, int] = {}  # id(output tensor) -> call index
        self._running: dict[Op, None] = {}
        self._handles: list[Any] = []
        self._keep_live = keep_live
        self._keep_alive: list[torch.Tensor] = []  # outputs stay alive so their ids stay unique

    # --- module tracking -------------------------------------------------------------

    def __enter__(self) -> Tracer:
        self._handles = [
            nn_module.register_module_forward_pre_hook(self._enter_module),
            nn_module.register_module_forward_hook(self._exit_module, always_call=True),
        ]
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _enter_module(self, module: torch.nn.Module, args: Any) -> None:
        self._modules.append(self._names.get(id(module), type(module).__name__))

    def _exit_module(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._modules:
            self._modules.pop()

    # --- op recording ----------------------------------------------------------------

    def __torch_function__(self, func: Op, types_: Any, args: Args = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if type(func) is types.FunctionType and func not in self._running:
            return transparent.run_transparently(self, self._running, func, types_, args, kwargs)
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name not in _NOT_COMPUTE and not name.endswith("_"):
            self._record(name, (*args, *kwargs.values()), out)
        return out

    def _record(self, name: str, inputs: tuple[Any, ...], out: Any) -> None:
        outputs = float_tensors(out)
        if not outputs:
            return
        tensor, tensors = outputs[0], float_tensors(inputs)
        module = self._modules[-1] if self._modules else ""
        occurrence = self._counts.get((module, name), 0)
        self._counts[(module, name)] = occurrence + 1
        call = OpCall(
            index=len(self.calls),
            module=module,
            op=name,
            occurrence=occurrence,
            output=tensor.detach().clone(),
            inputs_finite=all(bool(torch.isfinite(t).all()) for t in tensors),
            producers=sorted({self._producer[id(t)] for t in tensors if id(t) in self._producer}),
        )
        if not bool(torch.isfinite(call.output).all()) and call.inputs_finite:
            call.stack = traceback.extract_stack()
            call.source = user_source(call.stack)
        if self._keep_live and tensor.requires_grad:
            call.live_output = tensor
        self._producer[id(tensor)] = call.index
        self._keep_alive.append(tensor)
        self.calls.append(call)
