"""The autocast policy as an immutable value: op rules, per-dtype rules, module rules.

A :class:`Policy` says, for one device type, what autocast does with each op
(a :class:`~amped.policy.ops.Cast` per op), optionally differently for float16 and
bfloat16, and which submodules run in float32, in low precision, or untouched.
It holds names and objects only; the engine in :mod:`amped.autocast_mode` applies it.
"""

from __future__ import annotations

import fnmatch
import functools
import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

import torch

from amped._internal.errors import type_error, value_error
from amped.policy.created import notify_created
from amped.policy.ops import TORCH_OP_TABLES, Cast, OpKey, check_op, op_label, torch_default_rules

__all__ = ["LOW_DTYPES", "ModuleRule", "Policy", "Precision"]

Precision = Literal["fp32", "low", "skip"]
LOW_DTYPES = (torch.float16, torch.bfloat16)
_PRECISIONS = ("fp32", "low", "skip")
_DEVICE_TYPES = tuple(TORCH_OP_TABLES)


@dataclass(frozen=True)
class ModuleRule:
    """Run every call inside matching submodules at one precision.

    Args:
        selector: a module class (matches instances of it and its subclasses) or a
            glob over qualified names relative to the outermost module called in the
            region (``"encoder.layers.*.norm1"``, ``"lm_head"``).
        precision: ``"fp32"``: floating positional inputs are cast to float32 on entry
            and every op the policy lists runs in float32; ``"low"``: every op the policy
            lists runs in the low dtype; ``"skip"``: autocast is off inside, as under
            ``autocast(enabled=False)``. Like op rules, a rule applies where autocast is
            on: where it is off for their device type (a nested
            ``autocast(enabled=False)``, a ``"skip"`` rule around), an ``"fp32"`` module
            leaves its inputs as they are, as ``custom_fwd(cast_inputs=...)`` does.
    """

    selector: type[torch.nn.Module] | str
    precision: Precision

    def matches(self, module: torch.nn.Module, qualified_name: str | None) -> bool:
        if isinstance(self.selector, str):
            return qualified_name is not None and fnmatch.fnmatchcase(qualified_name, self.selector)
        return isinstance(module, self.selector)

    def __str__(self) -> str:
        sel = self.selector if isinstance(self.selector, str) else self.selector.__qualname__
        return f"{sel} -> {self.precision}"


def _check_dtype(dtype: object) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or dtype not in LOW_DTYPES:
        raise value_error(
            "Per-dtype rules apply to autocast's low dtypes, torch.float16 or torch.bfloat16",
            "dtype",
            dtype,
        )
    return dtype


def _frozen(mapping: Mapping[Any, Any]) -> Mapping[Any, Any]:
    return MappingProxyType(dict(mapping))


class Policy:
    """Which ops autocast runs in low precision, in float32, or at the widest input type.

    A policy belongs to one device type. Build one from a preset and derive new ones
    with :meth:`with_ops` and :meth:`with_module`; a policy never changes after it is
    made, so it can be shared, compared (``==``) and used as a dict key.

    Example:
        >>> import torch, amped
        >>> policy = amped.Policy.preset("torch", "cpu").with_ops(fp32=["softmax"])
        >>> policy.cast_for("softmax", torch.bfloat16)
        Cast.FP32
        >>> x = torch.randn(4, 4)
        >>> with amped.autocast("cpu", policy=policy):
        ...     torch.softmax(x @ x, dim=-1).dtype
        torch.float32
    """

    __slots__ = (
        "_dtype_rules",
        "_engine_cache",
        "_hash",
        "_module_rules",
        "_rules",
        "device_type",
        "name",
    )

    def __init__(
        self,
        device_type: str,
        rules: Mapping[OpKey, Cast],
        *,
        dtype_rules: Mapping[torch.dtype, Mapping[OpKey, Cast]] | None = None,
        module_rules: Iterable[ModuleRule] = (),
        name: str = "custom",
    ) -> None:
        if device_type not in _DEVICE_TYPES:
            raise value_error(
                f"amped has autocast policies for device types {list(_DEVICE_TYPES)}",
                "device_type",
                device_type,
            )
        for op, cast in rules.items():
            check_op(op)
            if not isinstance(cast, Cast):
                message = f"The rule for {op_label(op)} must be a Cast, such as Cast.FP32"
                raise type_error(message, "rule", cast)
        self.device_type = device_type
        self.name = name
        self._rules = _frozen(rules)
        self._dtype_rules = _frozen(
            {_check_dtype(d): _frozen(r) for d, r in (dtype_rules or {}).items() if r}
        )
        self._module_rules = tuple(module_rules)
        # The engine's tables for this policy (see amped.policy.created); not its value.
        self._engine_cache: dict[Any, Any] = {}
        self._hash = hash(
            (
                device_type,
                frozenset(self._rules.items()),
                frozenset((d, frozenset(r.items())) for d, r in self._dtype_rules.items()),
                self._module_rules,
            )
        )
        notify_created(self)

    # --- presets ---------------------------------------------------------------

    @classmethod
    @functools.cache
    def preset(cls, name: str, device_type: str) -> Policy:
        """A named policy for ``device_type`` (``"cpu"`` or ``"cuda"``).

        ``device_type`` has no default, as in ``torch.autocast(device_type, ...)``: a
        policy belongs to one device type, and a wrong guess would silently apply
        another device's op lists.

        Presets:
            ``"torch"``: torch's own lists for ``device_type`` as the installed release
                has them. The default: bitwise identical to ``torch.autocast``.
            ``"strict"``: ``"torch"`` plus CUDA's float32 list (softmax, log_softmax,
                exp, log, pow, norms, sums, ...). On CPU, torch leaves those in
                bfloat16; this preset keeps them in float32.
        """
        rules: dict[OpKey, Cast] = {op: c for op, c in torch_default_rules(device_type).items()}
        if name == "torch":
            return cls(device_type, rules, name="torch")
        if name == "strict":
            fp32_kinds = (Cast.FP32, Cast.FP32_SET_OPT_DTYPE, Cast.FP32_APPEND_DTYPE)
            for op, cast in torch_default_rules("cuda").items():
                if cast in fp32_kinds and op not in rules:
                    rules[op] = cast
            return cls(device_type, rules, name="strict")
        raise value_error(
            f"Unknown policy preset {name!r}; presets are 'torch' (torch's own lists, the "
            "default) and 'strict' (float32 for softmax, exp, log and norms on every device)",
            "name",
            name,
        )

    # --- queries ---------------------------------------------------------------

    @property
    def rules(self) -> Mapping[OpKey, Cast]:
        """The rules that apply to both low dtypes."""
        return self._rules

    @property
    def dtype_rules(self) -> Mapping[torch.dtype, Mapping[OpKey, Cast]]:
        """Per-dtype rules, which take precedence over :attr:`rules` for that dtype."""
        return self._dtype_rules

    @property
    def module_rules(self) -> tuple[ModuleRule, ...]:
        return self._module_rules

    def rules_for(self, dtype: torch.dtype) -> dict[OpKey, Cast]:
        """Every op rule in force when autocast's low dtype is ``dtype``."""
        merged = dict(self._rules)
        merged.update(self._dtype_rules.get(dtype, {}))
        return merged

    def cast_for(self, op: OpKey, dtype: torch.dtype) -> Cast | None:
        """The rule for ``op`` under ``dtype``, or None when the policy does not list it."""
        per_dtype = self._dtype_rules.get(dtype)
        if per_dtype is not None and op in per_dtype:
            return per_dtype[op]
        return self._rules.get(op)

    # --- derivation ------------------------------------------------------------

    def with_ops(
        self,
        *,
        lower: Iterable[OpKey] = (),
        fp32: Iterable[OpKey] = (),
        fp32_low_out: Iterable[OpKey] = (),
        promote: Iterable[OpKey] = (),
        keep: Iterable[OpKey] = (),
        dtype: torch.dtype | None = None,
        **categories: Iterable[OpKey],
    ) -> Policy:
        """A new policy with ops moved into categories.

        Args:
            lower: ops to run in the low dtype.
            fp32: ops to run in float32 (output float32).
            fp32_low_out: ops to compute in float32 and return in the low dtype.
            promote: ops to run at the widest floating input type.
            keep: ops to run on their inputs untouched, by amped and torch alike.
            dtype: apply these moves only when the low dtype is ``dtype``
                (``torch.float16`` or ``torch.bfloat16``); by default they apply to both.
            **categories: any other :class:`Cast` by lower-case name, e.g.
                ``fp32_set_opt_dtype=["my_softmax"]`` or ``banned=[...]``.
        """
        moves: dict[OpKey, Cast] = {}
        groups = dict(lower=lower, fp32=fp32, fp32_low_out=fp32_low_out, promote=promote)
        groups.update(keep=keep, **categories)
        for category, ops in groups.items():
            try:
                cast = Cast(category)
            except ValueError:
                raise type_error(
                    f"with_ops() got an unknown category {category!r}; categories are "
                    f"{[c.value for c in Cast]}",
                    category,
                    ops,
                ) from None
            if isinstance(ops, str):
                raise type_error(
                    f"with_ops({category}=...) takes a list of ops, not one string; write "
                    f"{category}=[{ops!r}]",
                    category,
                    ops,
                )
            for op in ops:
                moves[check_op(op)] = cast
        rules = dict(self._rules)
        dtype_rules = {d: dict(r) for d, r in self._dtype_rules.items()}
        if dtype is None:
            rules.update(moves)
            for per_dtype in dtype_rules.values():
                for op in moves:
                    per_dtype.pop(op, None)
        else:
            dtype_rules.setdefault(_check_dtype(dtype), {}).update(moves)
        return self._derive(rules=rules, dtype_rules=dtype_rules)

    def with_module(self, selector: type[torch.nn.Module] | str, precision: Precision) -> Policy:
        """A new policy that runs matching submodules at ``precision`` (see :class:`ModuleRule`)."""
        if precision not in _PRECISIONS:
            raise value_error(
                f"Module precision must be one of {list(_PRECISIONS)}", "precision", precision
            )
        if isinstance(selector, str):
            if not selector:
                message = "A module name pattern must not be empty; pass a glob like 'encoder.*'"
                raise value_error(message, "selector", selector)
        elif not (isinstance(selector, type) and issubclass(selector, torch.nn.Module)):
            raise type_error(
                "A module selector is a torch.nn.Module subclass or a qualified-name glob",
                "selector",
                selector,
            )
        rules = (*self._module_rules, ModuleRule(selector, precision))
        return self._derive(module_rules=rules)

    def _derive(self, **changes: Any) -> Policy:
        fields: dict[str, Any] = dict(
            rules=self._rules,
            dtype_rules=self._dtype_rules,
            module_rules=self._module_rules,
            name=f"{self.name}+" if not self.name.endswith("+") else self.name,
        )
        fields.update(changes)
        return Policy(self.device_type, **fields)

    # --- value semantics ---------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Policy):
            return NotImplemented
        return (
            self.device_type == other.device_type
            and dict(self._rules) == dict(other._rules)
            and {d: dict(r) for d, r in self._dtype_rules.items()}
            == {d: dict(r) for d, r in other._dtype_rules.items()}
            and self._module_rules == other._module_rules
        )

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild,
            (
                self.device_type,
                dict(self._rules),
                {d: dict(r) for d, r in self._dtype_rules.items()},
                self._module_rules,
                self.name,
            ),
        )

    def __copy__(self) -> Policy:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Policy:
        return self

    def __repr__(self) -> str:
        return (
            f"Policy({self.device_type!r}, name={self.name!r}, {len(self._rules)} op rules, "
            f"{sum(len(r) for r in self._dtype_rules.values())} per-dtype rules, "
            f"{len(self._module_rules)} module rules)"
        )

    def __str__(self) -> str:
        lines = [f"Policy {self.name!r} for {self.device_type}"]
        lines += _format_table(self._rules, indent="  ")
        for dtype, per_dtype in self._dtype_rules.items():
            lines.append(f"  only under {dtype}:")
            lines += _format_table(per_dtype, indent="    ")
        if self._module_rules:
            lines.append("  modules:")
            lines += [f"    {rule}" for rule in self._module_rules]
        return "\n".join(lines)


def _rebuild(
    device_type: str,
    rules: dict[OpKey, Cast],
    dtype_rules: dict[torch.dtype, dict[OpKey, Cast]],
    module_rules: tuple[ModuleRule, ...],
    name: str,
) -> Policy:
    return Policy(device_type, rules, dtype_rules=dtype_rules, module_rules=module_rules, name=name)


def _format_table(rules: Mapping[OpKey, Cast], indent: str) -> list[str]:
    lines = []
    for cast in Cast:
        names = sorted(op_label(op) for op, c in rules.items() if c is cast)
        if names:
            head = f"{indent}{cast.value} ({len(names)}): "
            lines += textwrap.wrap(
                ", ".join(names), width=96, initial_indent=head, subsequent_indent=indent + "    "
            )
    return lines
