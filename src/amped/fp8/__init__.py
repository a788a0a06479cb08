# rewrite: keep-file (this shim names the old paths on purpose)
"""Deprecated: the FP8 and block formats moved to :mod:`amped.lowp`.

``amped.fp8.<name>`` still works for the names this package exported, for one release,
and warns with a ``DeprecationWarning`` saying where the name lives now. Its submodules
(``amped.fp8.cast``, ...) are gone: import from :mod:`amped.lowp.float8` and
:mod:`amped.lowp.mx`.
"""

from __future__ import annotations

import warnings
from typing import Any

__all__: list[str] = []

_MOVED = {
    "BLOCK_CONFIGS": "BLOCK_CONFIGS",
    "FP8_CONFIGS": "FP8_CONFIGS",
    "Float8Linear": "Float8Linear",
    "Fp8Config": "Fp8Config",
    "convert_to_fp8": "convert_to_fp8",
}
"""Old name -> its name in :mod:`amped.lowp`."""


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module 'amped.fp8' has no attribute {name!r}")
    from amped import lowp

    warnings.warn(
        f"amped.fp8.{name} is deprecated and will be removed in the next release; "
        f"use amped.lowp.{_MOVED[name]}",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(lowp, _MOVED[name])
