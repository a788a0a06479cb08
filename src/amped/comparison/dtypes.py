"""dtype names on the command line: as torch spells them, and the short aliases.

``amped doctor --dtype`` takes ``float16``/``fp16``/``half`` and
``bfloat16``/``bf16``; ``amped compare --recipes`` takes the same dtype names for the
mixed recipe of that dtype (``bfloat16`` is ``bf16-mixed``, ``float32`` is ``fp32``), next
to the recipes' own names and aliases.
"""

from __future__ import annotations

import torch

from amped.tasks.errors import UsageError

__all__ = ["DTYPES", "LOW_DTYPES", "dtype_name", "parse_low_dtype", "recipe_for_dtype"]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
"""Every accepted spelling (lower case), torch's first."""

LOW_DTYPES = (torch.float16, torch.bfloat16)

_RECIPE_OF_DTYPE = {
    torch.float32: "fp32",
    torch.float16: "fp16-mixed",
    torch.bfloat16: "bf16-mixed",
}


def dtype_name(dtype: torch.dtype) -> str:
    """torch's own spelling: ``bfloat16``, not ``torch.bfloat16``."""
    return str(dtype).removeprefix("torch.")


def _spellings(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join("/".join(name for name, d in DTYPES.items() if d == dtype) for dtype in dtypes)


def parse_low_dtype(text: str, option: str = "--dtype") -> torch.dtype:
    """A low-precision dtype from its torch name or alias; UsageError listing them otherwise."""
    dtype = DTYPES.get(text.strip().lower().removeprefix("torch."))
    if dtype is None or dtype not in LOW_DTYPES:
        raise UsageError(
            f"{option} must be a low-precision dtype: {_spellings(LOW_DTYPES)}. "
            f"Received: {option} {text!r}"
        )
    return dtype


def recipe_for_dtype(text: str) -> str | None:
    """The recipe a dtype name stands for in ``--recipes`` (None: not a dtype name)."""
    dtype = DTYPES.get(text.strip().lower().removeprefix("torch."))
    return None if dtype is None else _RECIPE_OF_DTYPE[dtype]
