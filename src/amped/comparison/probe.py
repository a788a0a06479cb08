"""Each recipe's peak memory, measured in a process that runs nothing else.

In one process freed pages and earlier recipes' caches drown a small model's growth, so
on a CPU each recipe also runs :data:`PROBE_STEPS` steps in a child Python process:
its kernel peak (``VmHWM``, reset once the float32 task is built) less its size then.

Before that, a recipe that compiles something once per process compiles it on a
dummy: bf16-pure's compensated optimizer steps a 4,096-element stand-in with the task's
hyper-parameters, so torch.compile's memory (tens of MiB of compiler state, more than
a small model's whole training state) is in the baseline, not in the recipe's peak.
Only that: a warm-up step on a copy of the model would leave its freed memory in the
allocator for the measured steps to reuse, and hide part of the recipe's growth.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from amped.comparison.run import CompareConfig, RecipeRun

__all__ = ["PROBE_KIND", "PROBE_STEPS", "ProbeResult", "probe_recipe"]

PROBE_STEPS = 3
PROBE_KIND = "own_process_peak_rss"
_TIMEOUT_S = 600.0
# glibc serves large blocks by mmap and returns them when freed, but by default it
# raises that threshold each time such a block is freed, after which blocks of that
# size come from the heap and stay in the resident size when freed: whether a freed
# gradient is still counted then depends on the order of frees, and the same fp32 run
# peaked at 42.7 or 57.7 MiB from one process to the next (wide MLP, 8.4M parameters).
# A fixed threshold (glibc's default start, 128 KiB) keeps it where it starts, so the
# peak follows the memory in use. Other C libraries ignore the variable.
_MMAP_THRESHOLD = str(128 << 10)
# Not ``python -m amped.comparison.probe``: importing amped imports this module first,
# and runpy then warns that it runs a module already in sys.modules.
_CHILD = "import sys; from amped.comparison.probe import _main; sys.exit(_main())"


@dataclass(frozen=True)
class ProbeResult:
    """What one recipe's own process measured (``error`` set when the recipe failed)."""

    peak_bytes: int | None
    step_times: list[float]
    error: str | None = None
    compile_s: float = 0.0  # seconds its process spent compiling before the steps


def probe_recipe(
    config: CompareConfig, run: RecipeRun, threads: int, timeout: float = _TIMEOUT_S
) -> ProbeResult:
    """Run ``run.recipe`` for :data:`PROBE_STEPS` steps in a fresh process and measure it.

    The process is killed after ``timeout`` seconds (the ``--max-time`` budget's share
    for probes); the result then has ``error`` set and no peak.
    """
    request = {
        "spec": config.factory.spec,
        "recipe": run.recipe.name,
        "batch_size": config.batch_size,
        "seed": config.seed,
        "device": str(config.device),
        "threads": threads,
        "steps": PROBE_STEPS,
        "module_filter": config.layers.module_filter,
        "exclude": config.layers.exclude,
        "attention": config.attention,
    }
    # The child sees the modules this process sees (a factory importable by name here).
    path = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": str(threads)}
    env["MALLOC_MMAP_THRESHOLD_"] = _MMAP_THRESHOLD  # see _MMAP_THRESHOLD
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            timeout=min(timeout, _TIMEOUT_S),
            env=env,
        )
    except subprocess.TimeoutExpired:
        return ProbeResult(None, [], f"the probe process ran past {timeout:.1f} s and was stopped")
    except OSError as error:
        return ProbeResult(None, [], f"the probe process failed: {error}")
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return ProbeResult(None, [], f"the probe process exited {done.returncode}: {tail}")
    answer = json.loads(lines[-1])
    return ProbeResult(
        answer["peak_bytes"], answer["step_times"], answer["error"], answer["compile_s"]
    )


# --- the child process -------------------------------------------------------------


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        return False
    return True


def _measure(request: dict[str, Any]) -> dict[str, Any]:
    from amped.comparison.footprint import PeakMemory, release_freed_memory
    from amped.comparison.layers import LayerChoice
    from amped.comparison.run import _train_step, prepare
    from amped.recipes.registry import resolve_recipe
    from amped.tasks.factory import load_factory
    from amped.tasks.task import to_device

    torch.set_num_threads(request["threads"])
    device = torch.device(request["device"])
    factory = load_factory(request["spec"])
    config = CompareConfig(factory, (), request["steps"], request["batch_size"], device,
                           request["seed"], None)  # fmt: skip
    run = RecipeRun(resolve_recipe(request["recipe"]), request["steps"], 0)
    task = factory.build(batch_size=config.batch_size, seed=config.seed, device=device)
    model = task.model.to(device)
    batches = iter(task.batches)
    began = time.monotonic()
    with contextlib.suppress(Exception):  # best effort: the real run reports any error
        _compile_once(task, run.recipe, device)
    compile_s = time.monotonic() - began
    release_freed_memory()
    before = _status_kib("VmRSS")
    reset = _reset_peak()
    layers = LayerChoice(request["module_filter"], request["exclude"])
    setup = prepare(model, task.optimizer(model), run.recipe, layers, request.get("attention"))
    sampler = PeakMemory(device)  # unused samples: the kernel's peak is the measure
    for _ in range(request["steps"]):
        batch = next(batches, None)
        if batch is None:
            break
        inputs, targets = to_device(batch, device)
        _train_step(setup, task, inputs, targets, run, sampler, config)
    peak = _status_kib("VmHWM") if reset else None
    if peak is None:  # no reset: the lifetime peak, in KiB on Linux
        peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    peak_bytes = None if before is None else max(0, peak - before) * 1024
    return {
        "peak_bytes": peak_bytes,
        "step_times": run.step_times,
        "error": None,
        "compile_s": compile_s,
    }


def _compile_once(task: Any, recipe: Any, device: torch.device) -> None:
    """Compile the fused optimizer kernels ``recipe`` will use, on a stand-in."""
    from amped.recipes.pure import compensated_twin

    if recipe.weights == "low-with-masters":  # the fused master-weight step's kernels
        _step_a_stand_in(task, recipe, device)
        return
    if recipe.compensation is None:
        return
    stand_in = torch.nn.Linear(64, 64, bias=False).to(device, recipe.dtype)
    # 64 x 64 = 4096 elements: under bf16-pure-8bit, quantized moments (its kernel).
    twin = compensated_twin(task.optimizer(stand_in), recipe.compensation, recipe.quantized_state)
    stand_in.weight.grad = torch.ones_like(stand_in.weight)
    for _ in range(2):  # SGD's second step is its first fused one
        twin.step()


def _step_a_stand_in(task: Any, recipe: Any, device: torch.device) -> None:
    """Two steps of ``recipe`` on a small stand-in model, so that its compiled step is
    built (and Inductor's memory spent) before the measured process state is read."""
    from amped.recipes import prepare

    stand_in = torch.nn.Linear(64, 64, bias=False).to(device)
    setup = prepare(stand_in, task.optimizer(stand_in), recipe)
    for _ in range(2):
        with setup.autocast():
            loss = setup.model(torch.ones(2, 64, device=device)).float().square().mean()
        setup.backward(loss)
        setup.step()
        setup.zero_grad()


def _main() -> int:
    request = json.loads(sys.stdin.read())
    began = time.monotonic()
    try:
        answer = _measure(request)
    except Exception as error:
        answer = {
            "peak_bytes": None,
            "step_times": [],
            "error": f"{type(error).__name__}: {error}",
            "compile_s": 0.0,
        }
    answer["wall_s"] = time.monotonic() - began
    print(json.dumps(answer))
    return 0
