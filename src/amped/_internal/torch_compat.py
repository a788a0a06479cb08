"""The one home for calls into torch's private APIs, and for torch-version checks.

torch's private names (``torch._C``, ``torch._dynamo``, ``torch.utils._pytree``,
``torch.amp.grad_scaler._...``) change between releases without notice. Every use of
one in amped goes through a small named function here, with a line saying why it is
needed, so that supporting a new torch release means reading this file only.
Sections are per layer; a layer adds wrappers in its own section.
"""

from __future__ import annotations

import re

import torch

__all__ = ["TORCH_VERSION", "torch_at_least"]

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

# --- autocast_mode ---

# --- scaling ---

# --- fp8 ---

# --- recipes ---

# --- doctor ---

# --- integrations ---

# --- cli ---
