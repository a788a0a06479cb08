"""Switches that exist only so that tests and benchmarks can force one of amped's paths.

User code never sets them; the library reads each where it picks the path. Kept in one
place, so that every way a test run can differ from a user's is listed here:

- :data:`CASTS`: how :func:`amped.lowp.float8.compiled_cast.run` casts (tests/conftest.py sets
  it for every test).

The engine's forced paths are :func:`amped.autocast_mode.engine.forced_path`, not here:
the doctor forces ``MODE`` with it too (docs/engine.md, "Forcing a path").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["CASTS", "casts"]

CASTS: str | None = None
"""None: the FP8 and block casts compile where the library decides (CPU tensors from
``compiled_cast.MIN_ELEMENTS`` up). ``"eager"``: every cast runs eagerly (a compile takes
seconds per shape; the compiled kernels give the eager bits, which the compiled-cast
tests show). ``"compiled"``: CPU casts compile whatever their size (those tests)."""

_CHOICES = (None, "eager", "compiled")


@contextlib.contextmanager
def casts(how: str | None) -> Iterator[None]:
    """Set :data:`CASTS` to ``how`` for the block (process-wide), then restore it."""
    global CASTS
    if how not in _CHOICES:
        raise ValueError(f"casts() takes one of {_CHOICES}. Received: how={how!r}")
    saved, CASTS = CASTS, how
    try:
        yield
    finally:
        CASTS = saved
