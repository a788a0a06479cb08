"""Where a comparison runs: the device (checked to exist) and a description for the report."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch

from amped._internal.version import __version__
from amped.lowp.float8.emulated_gemm import emulated_gemm
from amped.tasks.errors import UsageError

__all__ = ["cpu_name", "default_device", "describe", "resolve_device", "synchronize"]

# /proc/cpuinfo flags of native low-precision matmul units; without them torch emulates
# bf16/fp16 through float32, which is why low precision can be slower than float32.
_NATIVE_CPU_FLAGS = {
    "bfloat16": ("avx512_bf16", "amx_bf16"),
    "float16": ("avx512_fp16", "amx_fp16"),
}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(spec: str) -> torch.device:
    """``spec`` as a device that exists here; UsageError naming what is available otherwise."""
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        raise UsageError(
            f"--device must be a torch device such as cpu, cuda or cuda:1; "
            f"available here: {', '.join(_available())}. Received: --device {spec!r}"
        ) from None
    problem = _unavailable(device)
    if problem:
        raise UsageError(
            f"Device {spec!r} is not available: {problem}. Available here: "
            f"{', '.join(_available())}. Received: --device {spec!r}"
        )
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _unavailable(device: torch.device) -> str | None:
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "torch.cuda.is_available() is False (no CUDA device or a CPU-only torch)"
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            return f"there are {count} CUDA device(s)"
        return None
    return "amped's autocast supports the device types cpu and cuda"


def _available() -> list[str]:
    found = ["cpu"]
    if torch.cuda.is_available():
        found += ["cuda"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return found


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (so a step's time covers its kernels)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def describe(device: torch.device) -> dict[str, Any]:
    """The software and hardware a comparison ran on, as recorded in ``results.json``."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "amped": __version__,
        "platform": platform.platform(),
        "device": str(device),
        "cpu": cpu_name(),
        "cpu_capability": _cpu_capability(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "native_low_precision": _native_low_precision(device),
        # what the FP8 and block recipes' emulated GEMMs multiply in here, and why
        "emulated_gemm": emulated_gemm(device).as_dict(),
        "gpu": None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = {
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_bytes": int(props.total_memory),
            "cuda": torch.version.cuda,
        }
    return info


def _cpu_flags() -> set[str]:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return set()
    for line in cpuinfo.read_text(errors="replace").splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what platform says (also
    for the benchmarks, which print it beside every figure)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine() or "unknown"


def _cpu_capability() -> str | None:
    get = getattr(torch.backends.cpu, "get_cpu_capability", None)
    return str(get()) if get is not None else None


def _native_low_precision(device: torch.device) -> dict[str, bool | None]:
    """Whether the device has native bf16 / fp16 matmul units (None: unknown)."""
    if device.type == "cuda":
        major = torch.cuda.get_device_capability(device)[0]
        return {"bfloat16": major >= 8, "float16": major >= 7}
    flags = _cpu_flags()
    if not flags or sys.platform != "linux":
        return {"bfloat16": None, "float16": None}
    return {dtype: bool(flags & set(names)) for dtype, names in _NATIVE_CPU_FLAGS.items()}
