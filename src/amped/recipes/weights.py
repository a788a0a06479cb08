"""Which of a model's weights go to low precision under a recipe, and lowering them.

The autocast policy already says which submodules run in float32 (its module rules);
the weight-changing recipes read the same rules, so a module the policy keeps in
float32 also keeps float32 weights. A rule on a module covers its submodules unless
one of them has a rule of its own, exactly as the autocast engine applies them.

O2 adds torch's normalisation layers (and any module class whose name ends in "Norm",
such as transformers' ``LlamaRMSNorm``) to the policy as float32 modules, *before* the
user's rules, so a user rule on the same module wins.
"""

from __future__ import annotations

import torch

from amped.policy import ModuleRule, Policy

__all__ = ["kept_in_fp32", "lower_", "norm_classes", "with_norms_in_fp32"]

# torch's normalisation layers that hold weights or running statistics. Their
# reductions (mean, variance) lose most in low precision, which is why Apex O2
# ("keep_batchnorm_fp32"), Megatron and DeepSpeed keep them in float32.
_TORCH_NORMS: tuple[type[torch.nn.Module], ...] = (
    torch.nn.modules.batchnorm._NormBase,  # BatchNorm*, SyncBatchNorm, InstanceNorm*
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
    *((torch.nn.RMSNorm,) if hasattr(torch.nn, "RMSNorm") else ()),
)


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
    if policy is None or not policy.module_rules:
        return set()
    kept: set[str] = set()
    for name, module in model.named_modules():
        rule = _last_match(policy, module, name)
        if rule is not None:
            if rule.precision in ("fp32", "skip"):
                kept.add(name)
        elif name and _parent(name) in kept:
            kept.add(name)
    return kept


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
    with torch.no_grad():
        for name, module in model.named_modules():
            if name in keep:
                continue
            for param in module.parameters(recurse=False):
                if param.dtype is torch.float32 and param not in originals:
                    originals[param] = param.data
                    param.data = param.data.to(dtype)
            for key, buf in module.named_buffers(recurse=False):
                if buf is not None and buf.dtype is torch.float32:
                    setattr(module, key, buf.to(dtype))
    return originals
