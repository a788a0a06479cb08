"""Which of a model's weights go to low precision under a recipe, and lowering them.

A lowered model also casts its float32 tensor inputs to the low dtype on each call
(:func:`cast_inputs`, as Apex O2 does), so that ops autocast does not list (layer_norm
on CPU, a residual add) never meet a float32 input and a low-precision weight.

The autocast policy already says which submodules run in float32 (its module rules);
the weight-changing recipes read the same rules, so a module the policy keeps in
float32 also keeps float32 weights. A rule on a module covers its submodules unless
one of them has a rule of its own, exactly as the autocast engine applies them.

O2 adds torch's normalisation layers (and any module class whose name ends in "Norm",
such as transformers' ``LlamaRMSNorm``) to the policy as float32 modules, *before* the
user's rules, so a user rule on the same module wins.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from amped._internal.errors import value_error
from amped._internal.torch_compat import BATCH_NORM_BASE, fsdp_reset_sharded_params
from amped._internal.trees import map_tensors
from amped.lowp.float8.linear import Float8Linear
from amped.lowp.mx.block_linear import BlockLinear
from amped.optim.shards import fsdp_modules, is_sharded
from amped.policy import ModuleRule, Policy

__all__ = [
    "Lowering",
    "cast_inputs",
    "installed_on",
    "kept_in_fp32",
    "lower_",
    "lower_model_",
    "norm_classes",
    "require_float32",
    "restore_model_",
    "ruled_modules",
    "set_params_data_",
    "with_norms_in_fp32",
]

# torch's normalisation layers that hold weights or running statistics. Their
# reductions (mean, variance) lose most in low precision, which is why Apex O2
# ("keep_batchnorm_fp32"), Megatron and DeepSpeed keep them in float32.
_TORCH_NORMS: tuple[type[torch.nn.Module], ...] = (
    BATCH_NORM_BASE,  # BatchNorm*, SyncBatchNorm, InstanceNorm*
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
    torch.nn.RMSNorm,
)


# Low-precision layers converted before prepare (FSDP2 asks for that order) hold
# delayed scaling's amax histories and scales as float32 buffers: state of the casts,
# not of the model, kept in float32 whatever the weights are.
_SCALING_LAYERS = (Float8Linear, BlockLinear)


def require_float32(model: torch.nn.Module, why: str) -> None:
    """Refuse a model with floating parameters not in float32; ``why`` starts the message."""
    for name, param in model.named_parameters():
        if param.is_floating_point() and param.dtype is not torch.float32:
            raise value_error(f"{why}; pass the model in float32", f"{name}.dtype", param.dtype)


def norm_classes(model: torch.nn.Module) -> list[type[torch.nn.Module]]:
    """The normalisation layer classes that occur in ``model``, in order of appearance."""
    found: list[type[torch.nn.Module]] = []
    for module in model.modules():
        cls = type(module)
        is_norm = isinstance(module, _TORCH_NORMS) or cls.__name__.endswith("Norm")
        if is_norm and cls not in found:
            found.append(cls)
    return found


def with_norms_in_fp32(policy: Policy, model: torch.nn.Module) -> Policy:
    """``policy`` with float32 rules for the norm layers of ``model`` ahead of its own rules."""
    norms = tuple(ModuleRule(cls, "fp32") for cls in norm_classes(model))
    if not norms:
        return policy
    return Policy(
        policy.device_type,
        policy.rules,
        dtype_rules=policy.dtype_rules,
        module_rules=(*norms, *policy.module_rules),
        name=f"{policy.name}+norms-fp32",
    )


def kept_in_fp32(model: torch.nn.Module, policy: Policy | None) -> set[str]:
    """Qualified names of the submodules that run in float32 under ``policy``.

    A module runs in float32 when the last module rule matching it says ``"fp32"`` or
    ``"skip"`` (autocast off: the module sees float32 weights, as under O1), or, with
    no rule of its own, when its parent does. Names are relative to ``model``, as the
    engine names them when ``model`` is the outermost module called in the region.
    """
    return _ruled(model, policy, lambda rule: rule.precision in ("fp32", "skip"))


def ruled_modules(model: torch.nn.Module, policy: Policy | None) -> set[str]:
    """Qualified names of the modules a module rule of ``policy`` matches, and their children."""
    return _ruled(model, policy, lambda rule: True)


def _ruled(
    model: torch.nn.Module, policy: Policy | None, counts: Callable[[ModuleRule], bool]
) -> set[str]:
    """Modules whose last matching rule ``counts``, and those with no rule of their own
    whose parent is one, as the engine applies rules to submodules."""
    if policy is None or not policy.module_rules:
        return set()
    found: set[str] = set()
    for name, module in model.named_modules():
        rule = _last_match(policy, module, name)
        if rule is not None:
            if counts(rule):
                found.add(name)
        elif name and _parent(name) in found:
            found.add(name)
    return found


def _last_match(policy: Policy, module: torch.nn.Module, name: str) -> ModuleRule | None:
    for rule in reversed(policy.module_rules):  # later rules take precedence
        if rule.matches(module, name):
            return rule
    return None


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def lower_(
    model: torch.nn.Module, dtype: torch.dtype, keep: set[str]
) -> dict[torch.Tensor, torch.Tensor]:
    """Cast the floating parameters and buffers of every module not in ``keep`` to ``dtype``.

    In place, as ``model.to(dtype)`` does: a parameter keeps its identity (the optimizer,
    hooks and tied weights still see the same object) and gets a new ``.data``.

    Returns:
        each lowered parameter's original float32 tensor, by parameter. Nothing is
        copied: the original storage simply stops being the parameter's data, so O2
        can keep it as the master copy at no extra allocation.
    """
    originals: dict[torch.Tensor, torch.Tensor] = {}
    record = _LOWERINGS.setdefault(model, Lowering())
    with torch.no_grad():
        for name, module in model.named_modules():
            if name in keep:
                continue
            for param in module.parameters(recurse=False):
                if param.dtype is torch.float32 and param not in originals:
                    originals[param] = _lower_param_(param, dtype)
            if isinstance(module, _SCALING_LAYERS):
                continue  # their buffers are cast scales and amaxes, float32 by rule
            for key, buf in module.named_buffers(recurse=False):
                if buf is not None and buf.dtype is torch.float32:
                    lowered = buf.to(dtype)
                    setattr(module, key, lowered)
                    record.buffers.append((module, key, buf, lowered))
    record.params.extend(originals)
    if any(is_sharded(param) for param in originals):
        _reset_fsdp_modules(model)
    return originals


def _lower_param_(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Give ``param`` ``dtype`` in place; returns its float32 tensor."""
    original = param.data if not is_sharded(param) else None
    replaced = _set_data_(param, param.detach().to(dtype))
    return original if original is not None else replaced


def _set_data_(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Make ``value`` ``param``'s data, in place (the object stays the same); returns
    the object now holding the old contents.

    A DTensor (an FSDP2 shard) gets new contents, as ``module.to(dtype)`` gives it:
    setting ``.data`` would change what the DTensor claims, not its local shard.
    """
    if not is_sharded(param):
        old = param.data
        param.data = value
        return old
    new = torch.nn.Parameter(value, requires_grad=param.requires_grad)
    torch.utils.swap_tensors(param, new)
    return new


def set_params_data_(model: torch.nn.Module, values: dict[torch.Tensor, torch.Tensor]) -> None:
    """Give each parameter of ``model`` in ``values`` that data, in place (FSDP2 shards
    included: their ``fully_shard`` modules then take them up)."""
    with torch.no_grad():
        for param, value in values.items():
            _set_data_(param, value)
    if any(is_sharded(param) for param in values):
        _reset_fsdp_modules(model)


def _reset_fsdp_modules(model: torch.nn.Module) -> None:
    """Have every ``fully_shard`` module of ``model`` take up its new shards (it keeps
    its own references to them, and all-gathers in their dtype from now on)."""
    for module in fsdp_modules(model):
        fsdp_reset_sharded_params(module)


def cast_inputs(model: torch.nn.Module, dtype: torch.dtype) -> RemovableHandle:
    """Cast float32 tensors among ``model``'s call arguments (nested in lists, tuples,
    namedtuples and dicts too) to ``dtype``, on every call. Returns the hook's handle."""

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(dtype) if tensor.dtype is torch.float32 else tensor

    def hook(
        module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, Any]:
        return map_tensors(cast, args), map_tensors(cast, kwargs)

    return model.register_forward_pre_hook(hook, with_kwargs=True)


def lower_model_(
    model: torch.nn.Module, dtype: torch.dtype, policy: Policy | None
) -> dict[torch.Tensor, torch.Tensor]:
    """Lower every module ``policy`` does not keep in float32, and cast the model's inputs
    (unless the policy keeps the whole model in float32). Returns :func:`lower_`'s originals."""
    keep = kept_in_fp32(model, policy)
    originals = lower_(model, dtype, keep)
    if "" not in keep:
        _LOWERINGS[model].hook = cast_inputs(model, dtype)
    return originals


@dataclass
class Lowering:
    """What :func:`lower_model_` installed on a model, so that it can be undone.

    Attributes:
        params: the parameters whose data was lowered.
        buffers: ``(module, name, original float32 buffer, lowered buffer)`` per buffer.
        hook: the handle of the input-casting forward pre-hook, if one was installed.
    """

    params: list[torch.Tensor] = field(default_factory=list)
    buffers: list[tuple[torch.nn.Module, str, torch.Tensor, torch.Tensor]] = field(
        default_factory=list
    )
    hook: RemovableHandle | None = None


_LOWERINGS: weakref.WeakKeyDictionary[torch.nn.Module, Lowering] = weakref.WeakKeyDictionary()


def installed_on(model: torch.nn.Module) -> Lowering | None:
    """What :func:`lower_` and :func:`lower_model_` installed on ``model`` (None: nothing)."""
    return _LOWERINGS.get(model)


def restore_model_(model: torch.nn.Module) -> None:
    """Remove the input-casting hook and give lowered buffers float32 tensors again.

    A buffer training left unchanged gets its original float32 tensor back (bitwise);
    one that changed (running statistics) gets a float32 copy of its current value.
    Parameters are the recipe's to restore (O2 holds their float32 masters). Idempotent.
    """
    record = _LOWERINGS.pop(model, None)
    if record is None:
        return
    if record.hook is not None:
        record.hook.remove()
    for module, key, original, lowered in record.buffers:
        current = getattr(module, key)
        unchanged = current is lowered and torch.equal(original.to(lowered.dtype), lowered)
        setattr(module, key, original if unchanged else current.to(torch.float32))
