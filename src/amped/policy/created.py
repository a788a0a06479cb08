"""Listeners told of every :class:`~amped.policy.Policy` created.

The autocast layer (above this one) derives look-up tables from a policy. It builds
them when the policy is made, which happens outside any ``torch.compile`` trace, where
they could not be built; lower layers never import upper ones, so it registers here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["add_creation_listener", "notify_created"]

_LISTENERS: list[Callable[[Any], None]] = []


def add_creation_listener(listener: Callable[[Any], None]) -> None:
    """Call ``listener`` with every policy created from now on (once per listener)."""
    if listener not in _LISTENERS:
        _LISTENERS.append(listener)


def notify_created(policy: Any) -> None:
    """Tell every listener that ``policy`` was just created."""
    for listener in _LISTENERS:
        listener(policy)
