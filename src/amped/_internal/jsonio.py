"""JSON that carries non-finite numbers.

Strict JSON has no NaN or infinity. amped writes ``+inf`` and ``-inf`` as the strings
``"inf"`` and ``"-inf"`` (an overflow is a finding worth keeping) and NaN as ``null``
(a value that does not exist), and reads the two strings back as floats.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["from_json", "jsonable", "to_json"]


def jsonable(value: Any) -> Any:
    """``value`` with every non-finite float replaced as the module docstring says.

    Walks dicts, lists and tuples (tuples become lists, as ``json`` writes them).
    """
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {key: jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    return value


def to_json(value: Any, **dumps_kwargs: Any) -> str:
    """``json.dumps(jsonable(value))``, strict (``allow_nan=False``)."""
    return json.dumps(jsonable(value), allow_nan=False, **dumps_kwargs)


def _restore(value: Any) -> Any:
    if value == "inf":
        return math.inf
    if value == "-inf":
        return -math.inf
    if isinstance(value, dict):
        return {key: _restore(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_restore(item) for item in value]
    return value


def from_json(text: str) -> Any:
    """Parse ``text``, turning the strings ``"inf"`` and ``"-inf"`` back into floats."""
    return _restore(json.loads(text))
