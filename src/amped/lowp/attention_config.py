"""How low-precision attention casts each matmul's operands: one immutable value.

Attention runs six matmuls, and each is a *role* with its own cast rule (None: the role
runs in the inputs' precision, float32 arithmetic)::

    s  : S  = Q · Kᵀ         (forward; recomputed, with the same casts, in backward)
    o  : O  = P · V          (forward)
    dv : dV = Pᵀ · dO        (backward)
    dp : dP = dO · Vᵀ        (backward)
    dq : dQ = dS · K         (backward; dS = P * (dP - rowsum(P * dP)))
    dk : dK = dSᵀ · Q        (backward)

dS is the operand whose format matters most in backward (SageAttention's authors found
most of 8-bit attention's gradient error there): it enters only ``dq`` and ``dk``, so
``replace(config, dq=None, dk=None)`` keeps it in float32. The softmax, its row max
and log-sum-exp stay in float32 always.

A rule names a format for the role's two operands, and optionally another for the
gradient operand of a backward role (dO in ``dv`` and ``dp``, dS in ``dq`` and ``dk``):
FP8 ``"e4m3"`` and ``"e5m2"`` (power-of-two scales per ``scaling`` region:
``"tensorwise"``, per ``"head"``, or per ``"block"`` tile of ``block_size`` x
``block_size``), or ``"mxfp8"`` / ``"mxfp8-e5m2"`` (E8M0 scales per 32 elements along
the matmul's inner dim, ``rceil`` rounding as in torchao's MXFP8 training).

``causal_safe`` (the default) computes every scale under a mask over the positions a
query row can see (docs/attention.md says exactly how); ``causal_safe=False`` is the
*unsafe* variant, scales over whole regions as other stacks compute them, kept for
comparison only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from amped._internal.errors import type_error, value_error

__all__ = [
    "ATTENTION_CONFIGS",
    "FORMATS",
    "MX_BLOCK",
    "ROLES",
    "SCALINGS",
    "AttentionCast",
    "AttentionConfig",
    "resolve_config",
]

AttentionFormat = Literal["e4m3", "e5m2", "mxfp8", "mxfp8-e5m2"]
AttentionScaling = Literal["tensorwise", "head", "block"]

FORMATS: tuple[str, ...] = ("e4m3", "e5m2", "mxfp8", "mxfp8-e5m2")
SCALINGS: tuple[str, ...] = ("tensorwise", "head", "block")
ROLES: tuple[str, ...] = ("s", "o", "dv", "dp", "dq", "dk")
MX_BLOCK = 32
"""Elements per E8M0 scale of the MX formats (along the matmul's inner dim)."""


@dataclass(frozen=True)
class AttentionCast:
    """The cast of one attention matmul's operands.

    Attributes:
        format: ``"e4m3"``, ``"e5m2"``, ``"mxfp8"`` or ``"mxfp8-e5m2"``.
        scaling: FP8 only: one power-of-two scale per ``"tensorwise"`` operand, per
            ``"head"`` (each batch item's head), or per ``"block"`` tile.
        grad_format: the gradient operand's format in a backward role (dO or dS);
            None: ``format``.
    """

    format: AttentionFormat = "e4m3"
    scaling: AttentionScaling = "head"
    grad_format: AttentionFormat | None = None

    def __post_init__(self) -> None:
        for name in ("format", "grad_format"):
            value = getattr(self, name)
            if value not in FORMATS and not (name == "grad_format" and value is None):
                raise value_error(f"{name} is one of {FORMATS}", name, value)
        if self.scaling not in SCALINGS:
            raise value_error(f"scaling is one of {SCALINGS}", "scaling", self.scaling)

    @property
    def grad(self) -> str:
        """The gradient operand's format."""
        return self.grad_format or self.format

    def __str__(self) -> str:
        text = f"{self.format}/{self.scaling}"
        return text if self.grad_format is None else f"{text},grad={self.grad_format}"

    @classmethod
    def parse(cls, text: str) -> AttentionCast:
        """The rule a string spells: ``FORMAT[/SCALING][,grad=FORMAT]`` (what ``str``
        gives), e.g. ``"e4m3"``, ``"e4m3/block"``, ``"e4m3/head,grad=e5m2"``, ``"mxfp8"``."""
        head, _, grad = text.partition(",grad=")
        fmt, _, scaling = head.partition("/")
        return cls(fmt, scaling or "head", grad or None)  # type: ignore[arg-type]


@dataclass(frozen=True)
class AttentionConfig:
    """The cast rule of each attention matmul (None: the role is not cast).

    Attributes:
        s, o, dv, dp, dq, dk: the six roles (see :mod:`amped.lowp.attention_config`),
            each an :class:`AttentionCast`, its spelling (``"e4m3/block"``, stored
            parsed) or None.
        causal_safe: under a mask, compute every scale over visible positions only;
            False is the unsafe variant (whole-region scales), for comparison.
        block_size: query rows per tile of the computation, and the side of a
            ``"block"`` scaling tile; a multiple of 32.
    """

    s: AttentionCast | str | None = None
    o: AttentionCast | str | None = None
    dv: AttentionCast | str | None = None
    dp: AttentionCast | str | None = None
    dq: AttentionCast | str | None = None
    dk: AttentionCast | str | None = None
    causal_safe: bool = True
    block_size: int = 128

    def __post_init__(self) -> None:
        for role in ROLES:
            rule = getattr(self, role)
            if isinstance(rule, str):  # a role spelled as text: "e4m3/block"
                object.__setattr__(self, role, AttentionCast.parse(rule))
            elif rule is not None and not isinstance(rule, AttentionCast):
                raise type_error(
                    "each role is an AttentionCast, its spelling (e.g. 'e4m3/head,"
                    "grad=e5m2') or None",
                    role,
                    rule,
                )
        size = self.block_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 32 or size % 32:
            raise value_error(
                "block_size is a positive multiple of 32 (MX blocks of 32 must not "
                "straddle two tiles)",
                "block_size",
                size,
            )

    def rule(self, role: str) -> AttentionCast | None:
        """The rule of ``role`` (one of :data:`ROLES`)."""
        rule: AttentionCast | None = getattr(self, role)  # parsed in __post_init__
        return rule

    def rules(self) -> dict[str, AttentionCast]:
        """The roles that are cast, by name."""
        return {r: rule for r in ROLES if (rule := self.rule(r)) is not None}

    def replace(self, **changes: object) -> AttentionConfig:
        """A copy with ``changes`` (e.g. ``dq=None, dk=None``), checked again."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, object]:
        """Every role's spelling (None: not cast), ``causal_safe`` and ``block_size``: a
        JSON object that :meth:`from_dict` reads back to an equal config."""
        roles: dict[str, object] = {
            r: None if (c := self.rule(r)) is None else str(c) for r in ROLES
        }
        return roles | {"causal_safe": self.causal_safe, "block_size": self.block_size}

    @classmethod
    def from_dict(cls, data: object) -> AttentionConfig:
        """The config :meth:`to_dict` wrote.

        Raises:
            ValueError: ``data`` is not an object with exactly the keys :meth:`to_dict`
                writes, a role is not a rule's spelling or null, ``causal_safe`` not a
                bool, or ``block_size`` not a multiple of 32; the message says which.
        """
        keys = (*ROLES, "causal_safe", "block_size")
        if not isinstance(data, dict) or set(data) != set(keys):
            got = sorted(map(str, data)) if isinstance(data, dict) else type(data).__name__
            raise value_error(
                f"An attention config is written as an object with the keys {list(keys)}",
                "keys",
                got,
            )
        rules = {}
        for role in ROLES:
            text = data[role]
            if text is not None and not isinstance(text, str):
                raise value_error(
                    f"Attention role {role!r} is a rule's spelling (e.g. 'e4m3/head') or null",
                    role,
                    text,
                )
            rules[role] = None if text is None else AttentionCast.parse(text)
        if not isinstance(data["causal_safe"], bool):
            raise value_error("causal_safe is true or false", "causal_safe", data["causal_safe"])
        return cls(**rules, causal_safe=data["causal_safe"], block_size=data["block_size"])

    def __str__(self) -> str:
        parts = [f"{role}:{rule}" for role, rule in self.rules().items()] or ["off"]
        if not self.causal_safe:
            parts.append("unsafe-scales")
        return ",".join(parts)


_E4M3 = AttentionCast("e4m3")
_HYBRID = AttentionCast("e4m3", grad_format="e5m2")
_MX = AttentionCast("mxfp8")
_FP8 = AttentionConfig(_E4M3, _E4M3, _HYBRID, _HYBRID, _HYBRID, _HYBRID)

ATTENTION_CONFIGS: dict[str, AttentionConfig] = {
    "bf16": AttentionConfig(),
    "fp8-forward": AttentionConfig(s=_E4M3, o=_E4M3),
    "fp8": _FP8,
    "fp8-all-but-ds": _FP8.replace(dq=None, dk=None),
    "mxfp8": AttentionConfig(_MX, _MX, _MX, _MX, _MX, _MX),
}
"""Named configs: ``"bf16"`` casts nothing; ``"fp8-forward"`` the forward in E4M3;
``"fp8"`` all six roles, E4M3 with E5M2 gradients (Transformer Engine's hybrid format);
``"fp8-all-but-ds"`` the same with dS in float32; ``"mxfp8"`` all six in MXFP8."""


def resolve_config(config: str | AttentionConfig) -> AttentionConfig:
    """The config a preset name or a config value stands for."""
    if isinstance(config, AttentionConfig):
        return config
    if isinstance(config, str):
        if config in ATTENTION_CONFIGS:
            return ATTENTION_CONFIGS[config]
        raise value_error(
            f"config is an AttentionConfig or one of {sorted(ATTENTION_CONFIGS)}",
            "config",
            config,
        )
    raise type_error(
        "config is an AttentionConfig or a preset name (amped.lowp.attention_config."
        "ATTENTION_CONFIGS)",
        "config",
        config,
    )
