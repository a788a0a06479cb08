"""The GPU check's parts (what each runs, on CUDA and in the dry run) and how one is run.

Used by ``benchmarks/support/gpu_check.py``; see its docstring for the whole check.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

OP_LIST_TEST = "tests/autocast_mode/test_autocast_op_lists.py::test_cuda_lists_match_torch"
PYTEST = ("-m", "pytest", "-q", "-p", "no:cacheprovider")
PARTS = (
    "setup",
    "op_lists",
    "gpu_tests",
    "recipes",
    "fp8",
    "autocast_overhead",
    "scaler_overhead",
)
# Budgets (seconds) sum to more than the run's --total (450 by default): most parts
# take far less than theirs on an H200, and the total is what keeps the run short.
BUDGETS = {
    "setup": 60,
    "op_lists": 60,
    "gpu_tests": 75,
    "recipes": 105,
    "fp8": 120,
    "autocast_overhead": 75,
    "scaler_overhead": 45,
}
# The benchmarks' arguments on CUDA, and in the dry run (CPU, their smallest settings,
# one thread each: two parts run side by side).
# recipes on CUDA: 64 x 64 tokens (GPT-2 tiny's 64 positions), so the GPU has work, and
# fp16-master against fp16 O1 too (the fused master step's Triton kernels, both dtypes);
# fp8 on CUDA: fp8.py step's large layers (d=8192, 16384 tokens), 2 blocks to fit the budget.
CUDA_ARGS = {
    "recipes": "--device cuda --repeats 10 --warmup 3 --batch 64 --seq 64 --fp16",
    "fp8": "step --gpu-only --gpu-layers 2 --gpu-repeats 5 --gpu-steps 3",
    "autocast_overhead": "--device cuda --repeats 15 --no-compile",
    "scaler_overhead": "--device cuda --repeats 15 --iterations 10",
}
DRY_ARGS = {
    "recipes": "--device cpu --threads 1 --repeats 1 --warmup 1 --batch 1 --seq 8 --models encoder",
    "fp8": "step --threads 1 --repeats 1 --steps 1 --dim 16 --layers 1 --tokens 16 --gpu-dim 16 "
    "--gpu-layers 1 --gpu-tokens 16 --gpu-repeats 1 --gpu-steps 1",
    "autocast_overhead": "--device cpu --repeats 1 --models cnn --no-compile --calls 50",
    "scaler_overhead": "--device cpu --repeats 1 --iterations 1",
}
TAIL_LINES = 40
TOTAL_S = 450  # all parts together: 7.5 minutes, so the run ends inside 8 on an H200
# The dry run has no 8-minute goal and may share a busy CPU (CI, other jobs).
DRY_SLACK = 4


@dataclass(frozen=True)
class Part:
    """One part: a pytest run (``--junitxml`` added) or a script (``--json`` added)."""

    name: str
    kind: str
    args: tuple[str, ...]
    budget_s: float
    skip_reason: str | None = None


def gpu_test_files(root: Path) -> list[str]:
    """The test files that mark a test ``gpu`` (collecting only them keeps the part short)."""
    return sorted(
        str(path.relative_to(root))
        for path in (root / "tests").rglob("test_*.py")
        if "mark.gpu" in path.read_text()
    )


def parts_for(dry_run: bool, site: Path, root: Path) -> list[Part]:
    """Every part, in the order run, with its arguments for this mode."""
    slack = DRY_SLACK if dry_run else 1

    def part(name: str, kind: str, args: tuple[str, ...], skip: str | None = None) -> Part:
        return Part(name, kind, args, BUDGETS[name] * slack, skip)

    setup = ("benchmarks/support/gpu_check_setup.py", "--site", str(site))
    gpu_tests = (*PYTEST, "-m", "gpu", *gpu_test_files(root), "--deselect", OP_LIST_TEST)
    no_setup = "dry run: uses the running interpreter's packages" if dry_run else None
    parts = [
        part("setup", "script", setup, no_setup),
        part("op_lists", "pytest", (*PYTEST, OP_LIST_TEST)),
        part("gpu_tests", "pytest", gpu_tests),
    ]
    for name, args in (DRY_ARGS if dry_run else CUDA_ARGS).items():
        parts.append(part(name, "script", (f"benchmarks/{name}.py", *args.split())))
    return sorted(parts, key=lambda p: PARTS.index(p.name))


def run_command(
    command: list[str], timeout: float, env: dict[str, str], log: Path, cwd: Path
) -> dict:
    """Run ``command`` in its own process group, output to ``log``, killed at ``timeout``."""
    began = time.monotonic()
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
        )
        timed_out, cpu = _wait(process, timeout)
    code = process.returncode
    status = "timeout" if timed_out else "passed" if code == 0 else "failed"
    result = {"status": status, "returncode": code, "seconds": round(time.monotonic() - began, 1)}
    result["cpu_seconds"] = round(cpu, 1)
    result["log"] = str(log)
    lines = log.read_text(errors="replace").splitlines()
    result["output_tail"] = "\n".join(lines[-TAIL_LINES:])
    return result


def _wait(process: subprocess.Popen, timeout: float) -> tuple[bool, float]:
    """Reap ``process`` (killing its group at ``timeout``): whether it timed out, and its
    own CPU seconds (``wait4``'s, which parts running side by side do not mix)."""
    deadline, timed_out = time.monotonic() + timeout, False
    while True:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid:
            process.returncode = os.waitstatus_to_exitcode(status)
            return timed_out, usage.ru_utime + usage.ru_stime
        if not timed_out and time.monotonic() > deadline:
            os.killpg(process.pid, signal.SIGKILL)  # the part and anything it started
            timed_out = True
        time.sleep(0.05)


def read_junit(path: Path) -> dict | None:
    """Outcome counts, failures (id and message) and skip reasons from pytest's XML."""
    if not path.exists():
        return None
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures, skips = [], []
    for case in ET.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        outcome = next((child for child in case if child.tag in ("failure", "error")), None)
        skipped = case.find("skipped")
        if outcome is not None:
            counts["failed" if outcome.tag == "failure" else "errors"] += 1
            failures.append({"test": test, "message": (outcome.get("message") or "")[:500]})
        elif skipped is not None:
            counts["skipped"] += 1
            skips.append({"test": test, "reason": skipped.get("message") or ""})
        else:
            counts["passed"] += 1
    return {**counts, "failures": failures, "skips": skips}


ENVIRONMENT = """
import json, platform, torch
cuda = torch.cuda.is_available()
print(json.dumps({
    "python": platform.python_version(),
    "platform": platform.platform(),
    "torch": torch.__version__,
    "cuda_runtime": torch.version.cuda,
    "cudnn": torch.backends.cudnn.version() if cuda else None,
    "cuda_available": cuda,
    "gpu": torch.cuda.get_device_name() if cuda else None,
    "capability": list(torch.cuda.get_device_capability()) if cuda else None,
    "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    if cuda else None,
    "cpu_threads": torch.get_num_threads(),
}))
"""


def environment(root: Path, dry_run: bool) -> dict:
    """GPU, torch and CUDA versions (read in a child, so this process needs no torch)."""
    try:
        found = subprocess.run(
            [sys.executable, "-c", ENVIRONMENT], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        found = subprocess.CompletedProcess([], 1, "", "reading torch's environment took > 60 s")
    env = (
        json.loads(found.stdout.splitlines()[-1])
        if found.returncode == 0
        else {"cuda_available": False, "error": found.stderr.strip()[-500:]}
    )
    env["python_executable"] = sys.executable
    env["amped_commit"] = os.environ.get("AMPED_COMMIT") or _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain", "--untracked-files=no")
    env["amped_dirty"] = None if status is None else bool(status)
    env["device"] = "cpu" if dry_run else "cuda"
    return env


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    except OSError:  # no git on the machine: the commit is unknown, not an error
        return None
    return done.stdout.strip() if done.returncode == 0 else None
