"""Which dtype the emulated FP8 and block GEMMs multiply in: the fastest exact one here.

An emulated GEMM (:mod:`amped.lowp.float8.gemm`, :mod:`amped.lowp.mx.block_gemm`)
multiplies exact operands: FP8 values, or block values (an FP8 or FP4 element times a
power of two or an E4M3 scale, at most 6 significant bits), which bfloat16 and float32
both hold exactly. Either GEMM therefore forms exact products and sums them in float32 (oneDNN
accumulates bfloat16 GEMMs in float32); what differs is the speed:

- **bfloat16** where the device multiplies bfloat16 natively: AMX or AVX512-BF16
  CPUs (a bfloat16 GEMM 3-7 times faster than a float32 one on one Zen 4 core),
  Arm CPUs with BF16, CUDA GPUs of compute capability 8.0 and newer;
- **float32** where it does not: an AVX2 CPU (most laptops and many servers) runs a
  bfloat16 GEMM in scalar software, 10-100 times slower than a float32 one; an AVX512
  CPU without AVX512-BF16 has no bfloat16 dot product to gain from (not measured here).
  So the operands are made in float32 and the GEMM is float32's.

Each choice is exact; the bits differ only where the summation order does (and a
float32 GEMM followed by a scale rounds once where the bfloat16 one rounds twice, see
:mod:`amped.lowp.float8.gemm`). A GEMM with a float32 result always runs in float32.

**How it is chosen** (:func:`emulated_gemm`), in this order:

1. :func:`set_emulated_gemm` (``"bf16"``, ``"float32"``, ``"auto"``; None drops it);
2. the environment variable ``AMPED_EMULATED_GEMM`` (the same spellings), read at
   each GEMM;
3. ``"auto"``: from the device's capabilities, decided once per process and device
   type, deterministically (no timing, so the same machine gives the same bits every
   run). A CPU takes bfloat16 when oneDNN may use bfloat16 vector instructions
   (``torch.ops.mkldnn._is_mkldnn_bf16_supported()``, which ``ONEDNN_MAX_CPU_ISA``
   caps) *and* the CPU has bfloat16 dot-product instructions (AVX512-BF16 or AMX;
   any Arm CPU oneDNN accepts); float32 otherwise. So ``ONEDNN_MAX_CPU_ISA=AVX2``
   (how ``benchmarks/fp8.py layers --isa avx2`` emulates an AVX2 machine) chooses float32.
   A CUDA device takes bfloat16 from compute capability 8.0 on; other devices
   bfloat16.

``amped compare`` records the choice in its environment block (``results.json``:
``environment.emulated_gemm``).
"""

from __future__ import annotations

import functools
import os
import platform
from typing import Any, Literal, NamedTuple

import torch

from amped._internal import torch_compat
from amped._internal.errors import value_error

__all__ = [
    "CHOICES",
    "ENV_VAR",
    "EmulatedGemm",
    "emulated_gemm",
    "native_bf16_matmul",
    "set_emulated_gemm",
]

ENV_VAR = "AMPED_EMULATED_GEMM"
"""The environment variable that overrides the automatic choice."""

Choice = Literal["auto", "bf16", "float32"]
CHOICES: tuple[Choice, ...] = ("auto", "bf16", "float32")

_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "float32": torch.float32}
_set: Choice | None = None


class EmulatedGemm(NamedTuple):
    """The dtype emulated GEMMs multiply in on a device, and why.

    Attributes:
        dtype: ``torch.bfloat16`` or ``torch.float32``.
        chosen_by: ``"auto"`` (the device's capabilities), ``"env"``
            (``AMPED_EMULATED_GEMM``) or ``"set"`` (:func:`set_emulated_gemm`).
        reason: one line saying what decided it.
    """

    dtype: torch.dtype
    chosen_by: str
    reason: str

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"dtype": "bfloat16", "chosen_by": "auto", "reason": ...}``."""
        dtype = str(self.dtype).removeprefix("torch.")
        return {"dtype": dtype, "chosen_by": self.chosen_by, "reason": self.reason}


def _checked(choice: object, name: str) -> Choice:
    if choice not in CHOICES:
        raise value_error(
            f"The emulated GEMM dtype is one of {', '.join(CHOICES)} (auto: bf16 where the "
            "device has native bfloat16 matmul, else float32); use one of those",
            name,
            choice,
        )
    return choice


def set_emulated_gemm(choice: Choice | None) -> Choice | None:
    """Force the dtype of emulated GEMMs for this process (over ``AMPED_EMULATED_GEMM``)
    and return the previous setting; ``None`` goes back to the environment variable,
    else ``"auto"``. Takes effect at the next cast and GEMM.

    Example:
        >>> from amped.lowp.float8.emulated_gemm import emulated_gemm, set_emulated_gemm
        >>> previous = set_emulated_gemm("float32")
        >>> emulated_gemm("cpu").dtype
        torch.float32
        >>> _ = set_emulated_gemm(previous)

    Raises:
        ValueError: ``choice`` is not ``"auto"``, ``"bf16"``, ``"float32"`` or None.
    """
    global _set
    if choice is not None:
        _checked(choice, "choice")
    previous, _set = _set, choice
    return previous


def emulated_gemm(device: torch.device | str = "cpu") -> EmulatedGemm:
    """The dtype emulated GEMMs on ``device`` multiply in, and why (see the module).

    Raises:
        ValueError: ``AMPED_EMULATED_GEMM`` is set to something else than ``auto``,
            ``bf16`` or ``float32``.
    """
    device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
    if _set is not None and _set != "auto":
        return EmulatedGemm(_DTYPES[_set], "set", f"set_emulated_gemm({_set!r})")
    env = os.environ.get(ENV_VAR, "").strip().lower()
    if _set is None and env and env != "auto":
        choice = _checked(env, ENV_VAR)
        return EmulatedGemm(_DTYPES[choice], "env", f"{ENV_VAR}={choice}")
    native, reason = native_bf16_matmul(device_type)
    return EmulatedGemm(torch.bfloat16 if native else torch.float32, "auto", reason)


@functools.cache
def native_bf16_matmul(device_type: str) -> tuple[bool, str]:
    """Whether devices of ``device_type`` multiply bfloat16 natively, and what says so
    (decided once per process; see the module)."""
    if device_type == "cpu":
        if not torch_compat.onednn_has_bf16():
            return False, "oneDNN has no bfloat16 matmul at this CPU's ISA (e.g. AVX2)"
        x86 = platform.machine().lower() in ("x86_64", "amd64")
        if x86 and not torch_compat.cpu_has_native_bf16_dot():
            return False, "the CPU has no AVX512-BF16 or AMX (bfloat16 runs through float32)"
        return True, "native bfloat16 matmul (oneDNN: AVX512-BF16, AMX or Arm BF16)"
    if device_type == "cuda":
        if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8:
            return True, "bfloat16 tensor cores (compute capability 8.0+)"
        return False, "no bfloat16 tensor cores (compute capability below 8.0)"
    return True, f"{device_type}: bfloat16, the default"
