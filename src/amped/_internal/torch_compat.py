"""The one home for calls into torch's private APIs, and for torch-version checks.

torch's private names (``torch._C``, ``torch._dynamo``, ``torch.utils._pytree``,
``torch.amp.grad_scaler._...``) change between releases without notice. Every use of
one in amped goes through a small named function here, with a line saying why it is
needed, so that supporting a new torch release means reading this file only.
Sections are per layer; a layer adds wrappers in its own section.
"""

from __future__ import annotations

import re
import sys
from collections import OrderedDict
from typing import Any

import torch

__all__ = [
    "TORCH_VERSION",
    "foreach_add_",
    "foreach_copy_",
    "torch_at_least",
]

# --- compat ---


def _parse_version(text: str) -> tuple[int, int, int]:
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)``; pre-release and local parts are ignored."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if match is None:
        raise ValueError(f"cannot read a torch version from {text!r}")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


TORCH_VERSION: tuple[int, int, int] = _parse_version(torch.__version__)
"""The installed torch's ``(major, minor, patch)``."""


def torch_at_least(major: int, minor: int, patch: int = 0) -> bool:
    """Whether the installed torch is at least ``major.minor.patch``."""
    return (major, minor, patch) <= TORCH_VERSION


# --- policy ---


def aten_op_names() -> list[str]:
    """Every registered op's qualified name (``"aten::mm.out"``, ...): torch lists them
    only through the dispatcher's private API."""
    return list(torch._C._dispatch_get_all_op_names())


def has_kernel_for(qualified_name: str, dispatch_key: str) -> bool:
    """Whether ``qualified_name`` has a kernel for ``dispatch_key`` (e.g. ``"AutocastCPU"``):
    how the installed torch's autocast lists are read, since they live in C++."""
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(qualified_name, dispatch_key))


# --- autocast_mode ---
# The engine binds these at import and calls most of them per op, so they are the torch
# objects themselves (aliases), not wrappers: a wrapper would add a frame to every op.

OpOverload = torch._ops.OpOverload
"""One overload of an op (``torch.ops.aten.mm.default``): what the dispatcher runs."""
OpOverloadPacket = torch._ops.OpOverloadPacket
"""An op with all its overloads (``torch.ops.aten.mm``)."""
DispatchKey = torch._C.DispatchKey
"""The dispatcher's keys; torch's autocast kernels sit at ``Autocast<Device>``."""
DispatchKeySet = torch._C.DispatchKeySet
ExcludeDispatchKeyGuard = torch._C._ExcludeDispatchKeyGuard
"""Keeps a key set's kernels from running while held: how torch's C++ autocast is kept out."""
set_dispatch_key_excluded = torch._C._dispatch_tls_set_dispatch_key_excluded
"""``(key, bool)``: the guard's effect as two plain calls, several times cheaper per op."""
dispatch_keyset_full = torch._C._dispatch_keyset_full
dispatch_has_kernel = torch._C._dispatch_has_kernel
"""Whether an op has a dispatcher entry (TorchScript-only overloads have none)."""
is_cached_tensor = getattr(torch._C, "_is_cached_tensor")  # noqa: B009 - not in the stubs
"""Whether a tensor lives in a CUDA-graph pool (torch's autocast never caches those)."""
is_inference_mode_enabled = torch._C.is_inference_mode_enabled
"""The C function behind ``torch.is_inference_mode_enabled``, one frame less."""
torch_function_mode_enabled = torch._C._is_torch_function_mode_enabled
"""Whether a TorchFunctionMode is on the stack and enabled (Dynamo traces it)."""
len_torch_function_stack = torch._C._len_torch_function_stack
get_function_stack_at = torch._C._get_function_stack_at
push_torch_function_mode = torch._C._push_on_torch_function_stack
pop_torch_function_mode = torch._C._pop_torch_function_stack
"""The torch-function mode stack itself; ``with mode:`` costs several frames more."""
DisableTorchFunction = torch._C.DisableTorchFunction
"""Guard: no torch-function mode or subclass sees calls made while it is held."""
skip_one_hop_torch_function: Any = getattr(torch._C, "_skip_one_hop_torch_function", None)
"""Call a function with its own torch-function check skipped once (torch >= 2.13, else
None): the C function ``torch.overrides.redispatch_function`` wraps."""
AUTOCAST_ENTER_EXIT = (
    torch.amp.autocast_mode._enter_autocast,
    torch.amp.autocast_mode._exit_autocast,
)
"""What ``torch.autocast`` calls under torch.compile to enter and leave; the engine lets
them pass."""
OP_NAMESPACES: tuple[Any, ...] = (
    torch._C._VariableFunctions,
    torch._C._nn,
    getattr(torch._C, "_linalg"),  # noqa: B009 - not in torch's type stubs
    getattr(torch._C, "_fft"),  # noqa: B009
    getattr(torch._C, "_special"),  # noqa: B009
    torch._C.TensorBase,
)
"""The C-level namespaces whose functions are bound to ATen ops by name."""
dynamo_disable = torch._dynamo.disable
"""Decorator: Dynamo runs the function eagerly, outside the graph."""
assume_constant_result = torch._dynamo.assume_constant_result
"""Decorator: Dynamo calls the function once while tracing and folds its result."""
dynamo_callbacks = torch._dynamo.callback_handler
"""Dynamo's compile start/end callbacks (``torch._dynamo.reset()`` clears them)."""
dynamo_global_state = torch._C._dynamo.guards.GlobalStateGuard
"""A snapshot of the global state Dynamo guards every graph on (grad mode, each device
type's autocast state, threads, ...); its ``check()`` says whether it still holds."""
set_grad_enabled = torch._C._set_grad_enabled
"""``torch.set_grad_enabled``'s effect as one call, without the context manager's object."""


def amp_definitely_not_available() -> bool:
    """torch.cuda.amp's check (CUDA absent, or torch_xla imported): CUDA autocast then
    disables itself with a warning (the helper lives in a deprecated namespace)."""
    return bool(torch.cuda.amp.common.amp_definitely_not_available())


def op_schema(op: Any) -> Any:
    """The ``torch._C.FunctionSchema`` of an ``OpOverload`` (its private ``_schema``)."""
    return op._schema


def destroy_library(lib: torch.library.Library) -> None:
    """Undo every registration ``lib`` made (``Library._destroy``)."""
    lib._destroy()


def dynamo_is_compiling_flag() -> bool:
    """``torch.compiler.is_compiling()`` read from its module flag, without the two
    Python frames the public function costs (the fast path's kernels read it per call)."""
    return bool(torch.compiler._is_compiling_flag)


def dynamo_skip_code() -> Any:
    """Dynamo's ``skip_code(code)`` (never start a frame at ``code``), or None: the only
    way to keep Dynamo from compiling a function it would otherwise make a root frame."""
    eval_frame = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    return getattr(eval_frame, "skip_code", None)


def _functorch_config() -> Any:
    try:
        import torch._functorch.config as config
    except ImportError:  # pragma: no cover - every supported torch has it
        return None
    return config


FUNCTORCH_CONFIG: Any = _functorch_config()
"""``torch._functorch.config`` or None: its ``backward_pass_autocast`` sets the autocast
state compiled backward passes are traced with, and has no public setter."""


def config_entry(config: Any, name: str) -> Any:
    """The entry of torch's config module holding ``name``'s override in a ContextVar
    (``entry.user_override``), or None where the layout differs: setting the var costs a
    tenth of the module's ``__setattr__``, paid once per training step."""
    entry = getattr(config, "_config", {}).get(name) if config is not None else None
    known = (
        entry is not None
        and hasattr(entry, "user_override")
        and hasattr(config, "_hash_dirty_var")
        and hasattr(config, "_mark_get_dict_dirty")
        and getattr(entry, "alias", None) is None
    )
    return entry if known else None


def mark_config_changed(config: Any, name: str) -> None:
    """Tell torch's config module that ``name`` changed behind its ``__setattr__`` (its
    cached hash and dict are rebuilt)."""
    config._hash_dirty_var.set(True)
    config._mark_get_dict_dirty(name)


def mark_keywords(module: torch.nn.Module, hook_id: int, traced: bool) -> Any:
    """Have the global forward pre-hook ``hook_id`` receive ``module``'s keyword inputs in
    the module's current call; returns what :func:`unmark_keywords` takes.

    ``register_module_forward_pre_hook`` takes no ``with_kwargs``, but
    ``Module._call_impl`` asks the module's own table (``_forward_pre_hooks_with_kwargs``)
    whether a pre-hook takes keywords just before calling it, global ones included, so a
    mark set by an earlier global pre-hook counts in the same call. Eager, the mark is
    an item of that table (a tenth of a microsecond); ``traced`` (Dynamo traces the
    call), a new table: Dynamo traces setting a module's attribute, not an item of that
    dict, and the old table put back leaves the module as Dynamo guarded it."""
    table = module._forward_pre_hooks_with_kwargs
    if traced:
        module._forward_pre_hooks_with_kwargs = OrderedDict({**table, hook_id: True})
    else:
        table[hook_id] = True
    return table


def unmark_keywords(module: torch.nn.Module, hook_id: int, table: Any, traced: bool) -> None:
    """Undo :func:`mark_keywords` (``table``: what it returned)."""
    if traced:
        module._forward_pre_hooks_with_kwargs = table
    else:
        table.pop(hook_id, None)


# --- scaling ---


def amp_update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
) -> None:
    """torch's own kernel for its dynamic loss-scale rule, so the default is bitwise torch's."""
    torch._amp_update_scale_(
        scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval
    )


def amp_unscale_and_check_(
    grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> None:
    """torch's fused multiply-by-``inv_scale`` and inf/NaN check (sets ``found_inf`` to 1.0),
    one launch for a list of same-device, same-dtype tensors."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def foreach_zero_count(tensors: list[torch.Tensor]) -> torch.Tensor:
    """int64, 0-d: how many of ``tensors`` are zero in every element (NaN counts as
    non-zero).

    One multi-tensor max-abs pass (``torch._foreach_norm`` with ``ord=inf``), where a
    Python loop would pay a dispatch per tensor; the scaler's stall check uses it.
    """
    norms = torch._foreach_norm(tensors, float("inf"))
    return (torch.stack([n.float() for n in norms]) == 0).sum()


def sparse_values(tensor: torch.Tensor) -> torch.Tensor:
    """The values of a sparse tensor, coalesced or not (``values()`` refuses uncoalesced)."""
    return tensor._values()


def steps_with_amp_scaling(optimizer: object) -> bool:
    """Whether the optimizer unscales and skips inside its own step (torch's fused and
    capturable ones declare it with this private flag)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def dtensor_class() -> Any:
    """DTensor's class if its module is loaded, else None (no tensor can be one then).

    Looked up, never imported (importing it takes a second); its home was
    ``torch.distributed._tensor`` before torch 2.5.
    """
    for name in ("torch.distributed.tensor", "torch.distributed._tensor"):
        dtensor = getattr(sys.modules.get(name), "DTensor", None)
        if dtensor is not None:
            return dtensor
    return None


def process_group_device_types(group: torch.distributed.ProcessGroup) -> list[str]:
    """The device types a process group's backends communicate on (what
    ``all_gather_object`` reads to place its tensors)."""
    return [device.type for device in group._device_types]


def tensor_use_count(tensor: torch.Tensor) -> int:
    """How many references hold ``tensor``'s C++ object (its Python object counts as one;
    autograd, a pending collective or a C++ container add theirs). torch >= 2.3."""
    return int(tensor._use_count())  # type: ignore[attr-defined]


# --- fp8 ---


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    use_fast_accum: bool,
) -> torch.Tensor:
    """torch's FP8 GEMM kernel: private (``torch._scaled_mm``), with no public equivalent."""
    return torch._scaled_mm(
        a,
        b,
        scale_a=scale_a,
        scale_b=scale_b,
        out_dtype=out_dtype,
        use_fast_accum=use_fast_accum,
    )


def cpu_scaled_mm_takes_rowwise() -> bool:
    """Whether torch's CPU ``_scaled_mm`` takes row-wise scales (from 2.12; before, only
    one scale per operand)."""
    return torch_at_least(2, 12)


def onednn_has_bf16() -> bool:
    """Whether oneDNN runs bfloat16 matmuls with vector instructions at the ISA it may use
    here (AVX512 or newer on x86, BF16 on Arm), which ``ONEDNN_MAX_CPU_ISA`` caps:
    without, torch's CPU bfloat16 ``mm`` is scalar code. Private, no public equivalent."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def cpu_has_native_bf16_dot() -> bool:
    """Whether the CPU has bfloat16 dot-product instructions (x86: AVX512-BF16 or AMX),
    from cpuinfo; private in ``torch.cpu``, with no public equivalent."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


# A tensor subclass that behaves exactly as a plain tensor (every op's result a plain
# tensor), as nn.Parameter does: torch's own marker for "no __torch_function__ logic".
DISABLED_TORCH_FUNCTION: Any = torch._C._disabled_torch_function_impl


def make_wrapper_subclass(
    cls: type, shape: torch.Size, stride: tuple[int, ...], dtype: torch.dtype, device: Any
) -> Any:
    """A tensor of class ``cls`` with this metadata and no storage of its own (its
    ``__torch_dispatch__`` computes on tensors it holds): how torch's and torchao's
    tensor subclasses are made; underscore-named, with no public equivalent."""
    return torch.Tensor._make_wrapper_subclass(
        cls, shape, strides=stride, dtype=dtype, device=device, requires_grad=False
    )


def dtensor_local(dtensor: torch.Tensor) -> torch.Tensor:
    """The local tensor object a DTensor holds (``to_local()`` of a parameter returns a
    new view of it, which does not tell its class)."""
    return dtensor._local_tensor  # type: ignore[attr-defined]


def set_dtensor_local(dtensor: torch.Tensor, local: torch.Tensor) -> None:
    """Make ``local`` (same shape, strides and storage) the local tensor of ``dtensor``,
    in place: FSDP2 reads a shard's all-gather hooks from that object
    (``DTensor._local_tensor``), and does the same assignment itself."""
    dtensor._local_tensor = local  # type: ignore[attr-defined]


# --- recipes ---
# torch's multi-tensor ops (what torch.optim's foreach paths use; public in effect but
# underscore-named): one call copies or adds a list of tensors, where a Python loop
# would pay a dispatch per tensor. The compensated optimizers move their chunks with them.


def foreach_copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``d.copy_(s)`` for each pair (casting as ``copy_`` does)."""
    torch._foreach_copy_(dst, src)


def foreach_add_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``d.add_(s)`` for each pair."""
    torch._foreach_add_(dst, src)


def python_mode_active() -> bool:
    """Whether a Python TorchDispatchMode or TorchFunctionMode is active on this thread:
    torch.compile skips the frames it is asked to compile under one, so the compensated
    optimizers take their eager step there (a memory or FLOP counter, amped's engine)."""
    return bool(torch._C._len_torch_dispatch_stack() or torch._C._len_torch_function_stack())


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` rounded once, in compiled code (Inductor's prim: a fused multiply-add
    instruction), as torch's eager CPU kernels compute ``lerp``, ``addcmul`` and
    ``add(alpha=)``. Run eagerly, it rounds twice. Imported when first called: importing
    Inductor takes a second."""
    from torch._inductor import inductor_prims

    return inductor_prims.fma(a, b, c)


def mark_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Set the private mark torch's LR schedulers read (``_opt_called``, set by the
    wrapper they put on ``optimizer.step``) for a step that ran the optimizer's
    algorithm without calling its ``step``: no warning of a scheduler stepped first."""
    optimizer._opt_called = True  # type: ignore[attr-defined]


BATCH_NORM_BASE: type[torch.nn.Module] = torch.nn.modules.batchnorm._NormBase
"""The common base of BatchNorm*, SyncBatchNorm and InstanceNorm*: private, no public name."""


def init_optimizer_hooks(optimizer: torch.optim.Optimizer) -> None:
    """Give an optimizer that shares another's param groups torch's hook tables and step
    profiling wrapper: ``Optimizer.__setstate__({})`` sets up just those."""
    torch.optim.Optimizer.__setstate__(optimizer, {})


# --- doctor ---

# --- verification ---


def torch_dispatch_mode() -> type[Any]:
    """torch's ``TorchDispatchMode``: the base of a mode that sees every aten op below
    autograd, tensor subclasses' ops before their own dispatch (``amped.verify`` reads
    each GEMM's operands so)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


# --- integrations ---

# steps_with_amp_scaling: see the scaling section.


def track_step_for_scheduler(
    optimizer: torch.optim.Optimizer, replaces: torch.optim.Optimizer
) -> None:
    """Wrap ``optimizer.step`` as torch's LR schedulers do (once), for an optimizer swapped
    in under a scheduler: they read the private marks to warn of a scheduler stepped first.
    It counts as stepped if the optimizer it ``replaces`` had."""
    step = optimizer.step
    if not hasattr(step, "_wrapped_by_lr_sched"):

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            optimizer._opt_called = True  # type: ignore[attr-defined]
            return step(*args, **kwargs)

        wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        optimizer.step = wrapper  # type: ignore[method-assign]
        optimizer._opt_called = getattr(replaces, "_opt_called", False)  # type: ignore[attr-defined]


# --- cli ---


def fsdp_reset_sharded_params(module: torch.nn.Module) -> None:
    """Make FSDP2's ``fully_shard(module)`` take up parameters swapped in after sharding
    with a new dtype or all-gather hooks (``fsdp_pre_all_gather``): what
    ``FSDPModule._apply`` does after ``module.to(dtype)``, for the
    parameters of its own groups, plus what ``_apply`` leaves stale once the module has
    run (its dtypes, read at its first forward, and its all-gather buffers, made then).
    Call it between steps (the parameters resharded)."""
    state = module._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)  # torch < 2.12: one group at most
    if groups is None:
        groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
    with torch.no_grad():
        for group in groups:
            for fsdp_param in group.fsdp_params:
                fsdp_param.reset_sharded_param()
                fsdp_param._init_extensions()  # all-gather hooks of a new local tensor
                fsdp_param.all_gather_outputs = []
                if hasattr(fsdp_param, "_unsharded_param"):
                    del fsdp_param._unsharded_param
            group._init_mp_dtypes()
