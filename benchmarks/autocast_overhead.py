"""What amped's paths cost against torch.autocast, per call, per region and per step.

Each region decides its path on entry (``amped.autocast_mode.current_path``):

* "amped": the default policy, path ``TORCH``: torch's C++ autocast does the casts.
* "module": a module-rule policy (``Policy.with_module``) whose
  rule matches no module of these models (``nn.LSTM`` in float32), so it computes what
  torch computes: path ``TORCH`` plus the module rules' global hooks.
* "fast": a policy that changes one op rule (cdist, which these models never call):
  path ``KERNELS``, that op's rule as a Python kernel at torch's Autocast key.
* "kernels": the ``KERNELS`` path's worst case: every rule, torch's own too, routed
  through amped's kernels (the private ``forced_path(Path.KERNELS)``), so it computes
  what torch computes and only the kernels' cost differs.
* "pyop": a policy naming an ``@amped.autocast_op`` function the models never call:
  path ``KERNELS`` with no kernel registered.
* "engine": path ``MODE`` (the TorchFunctionMode), forced on the default policy
  (``forced_path(Path.MODE)``), so it computes what torch computes: the diagnostic path (the
  doctor), and the path of ``"low"`` module rules and of compiled regions.

Everything runs in one process, the sides interleaved (torch, engine, amped, then the
next order, ...), and the figures are medians over repeats. A train step's ratio is
paired: each block times torch, the side, the side, torch, back to back (ABBA, so that a
drift linear in time cancels), the blocks rotating over the sides; the ratio printed is
the median of the blocks' ratios, with a bootstrap 95 % interval of that median, so that
a reader sees whether 1.02 is met or only within noise. Times are the thread's CPU time
(``time.thread_time``) with torch on one thread: on a shared machine wall time mostly
measures the neighbours, CPU time the work.

Reported, with the engine's targets (docs/decisions/001-engine-paths.md):

* added us per listed op (``F.linear`` on 8x8, weight cached)  target <= 5
  (fast: an op whose rule is torch's; kernels: an op routed through amped's kernel)
* added us per untouched op (``torch.add`` on 8x8)             target <= 0.5
* added us per region enter+exit (a non-default policy)        target <= 10
* train-step ratio engine/torch on three models               target <= 1.02
* compiled train-step ratio, engine vs compiled torch.autocast target <= 1.02
  (engine: the cdist policy above; module: a LayerNorm-in-fp32 module rule, which also
  does more work; amped: the default path, the control)

On CUDA (``--device cuda``) models, data and regions are on the GPU, autocast's
default dtype there is float16, and times are wall time between two
``torch.cuda.synchronize()`` calls (the kernels are the work there, on another
processor). ``--json PATH`` also writes the figures to a file (for
``benchmarks/support/gpu_check.py``).

    python benchmarks/autocast_overhead.py [--repeats 15] [--models encoder,gpt2,cnn]
        [--compile-model encoder] [--compile-backend inductor] [--no-compile]
        [--device cpu] [--json PATH] [--calls 2000]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from support.device_sync import synchronize

import amped
from amped._internal.jsonio import to_json
from amped.autocast_mode import Path as EnginePath
from amped.autocast_mode import current_path, dispatch
from amped.autocast_mode.engine import forced_path
from amped.autocast_mode.mode import AutocastMode

SIDES = ("torch", "engine", "module", "fast", "kernels", "pyop", "amped")
KERNEL_SIDES = ("fast", "kernels", "pyop")  # the sides whose regions register kernels


@amped.autocast_op
def unused_op(x: torch.Tensor) -> torch.Tensor:
    """An ``@amped.autocast_op`` function these models never call."""
    return x * 2


CHANGED = amped.Policy.preset("torch", "cpu").with_ops(lower=["cdist"])  # torch: fp32
MODULE_RULE = amped.Policy.preset("torch", "cpu").with_module(nn.LSTM, "fp32")  # no LSTM here
PYTHON_OP = amped.Policy.preset("torch", "cpu").with_ops(lower=[unused_op])
DEVICE = "cpu"
CALLS = 2000  # calls (or regions) per timed sample


def set_device(device: str) -> None:
    """Run everything on ``device``: its regions, its policy, its models and data."""
    global CHANGED, DEVICE, MODULE_RULE, PYTHON_OP
    DEVICE = device
    CHANGED = amped.Policy.preset("torch", device).with_ops(lower=["cdist"])
    MODULE_RULE = amped.Policy.preset("torch", device).with_module(nn.LSTM, "fp32")
    PYTHON_OP = amped.Policy.preset("torch", device).with_ops(lower=[unused_op])


def set_calls(calls: int) -> None:
    """Set how many calls (or regions) one timed sample makes."""
    global CALLS
    CALLS = calls


def clock() -> float:
    """The thread's CPU time on the CPU; on CUDA wall time once queued kernels are done."""
    if DEVICE == "cpu":
        return time.thread_time()
    synchronize(DEVICE)
    return time.perf_counter()


def prepare(side: str) -> None:
    """Register exactly the kernels ``side`` uses (outside the timed part): none for
    torch, engine and amped; cdist's for fast; every rule's for kernels."""
    dispatch.release_kernels()
    if side in KERNEL_SIDES:
        with region(side):
            assert current_path(DEVICE) is EnginePath.KERNELS, current_path(DEVICE)
    gc.collect()  # registering allocates: collect now, not inside the timed part


@contextlib.contextmanager
def amped_engine():
    """amped.autocast with the default policy, through amped's Python engine."""
    with forced_path(EnginePath.MODE), amped.autocast(DEVICE):
        yield


@contextlib.contextmanager
def every_rule_through_kernels():
    with forced_path(EnginePath.KERNELS), amped.autocast(DEVICE, policy=CHANGED):
        yield


def region(side: str) -> contextlib.AbstractContextManager:
    if side == "torch":
        return torch.autocast(DEVICE)
    if side == "kernels":
        return every_rule_through_kernels()
    if side == "fast":
        return amped.autocast(DEVICE, policy=CHANGED)
    if side == "module":
        return amped.autocast(DEVICE, policy=MODULE_RULE)
    if side == "pyop":
        return amped.autocast(DEVICE, policy=PYTHON_OP)
    return amped_engine() if side == "engine" else amped.autocast(DEVICE)


def encoder(layers: int = 4) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    layer = nn.TransformerEncoderLayer(256, 8, 1024, dropout=0.1, batch_first=True)
    model = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).train().to(DEVICE)
    x = torch.randn(8, 32, 256, device=DEVICE)
    return model, lambda m: m(x).float().pow(2).mean()


def gpt2() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=4,
        n_embd=256,
        n_head=8,
        n_positions=128,
        vocab_size=1024,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config).train().to(DEVICE)
    ids = torch.randint(0, 1024, (4, 64), device=DEVICE)
    return model, lambda m: m(input_ids=ids, labels=ids).loss


def cnn() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10),
    ).train().to(DEVICE)  # fmt: skip
    x, y = torch.randn(32, 3, 32, 32, device=DEVICE), torch.randint(0, 10, (32,), device=DEVICE)
    return model, lambda m: F.cross_entropy(m(x), y)


MODELS = {"encoder": encoder, "gpt2": gpt2, "cnn": cnn}


def orders(i: int, sides: tuple[str, ...]) -> tuple[str, ...]:
    return sides[i % len(sides) :] + sides[: i % len(sides)]


def interleaved(measure: Callable[[str], float], sides: tuple[str, ...], repeats: int):
    samples: dict[str, list[float]] = {side: [] for side in sides}
    gc.collect()
    gc.freeze()  # prepare's collection then sees only what is new (a full one takes 0.1 s)
    try:
        for i in range(repeats):
            for side in orders(i, sides):
                prepare(side)
                samples[side].append(measure(side))
    finally:
        gc.unfreeze()
    prepare("torch")
    return samples


def added(samples: dict[str, list[float]], side: str) -> float:
    return statistics.median(samples[side]) - statistics.median(samples["torch"])


def ratio(samples: dict[str, list[float]], side: str) -> float:
    pairs = zip(samples[side], samples["torch"], strict=True)
    return statistics.median(a / t for a, t in pairs)


def per_call(repeats: int) -> dict[str, float]:
    """Added microseconds per call, for the calls the engine sees."""
    a, w = torch.randn(8, 8, device=DEVICE), torch.randn(8, 8, device=DEVICE, requires_grad=True)
    kinds = {
        "listed op (F.linear)": lambda: F.linear(a, w),
        "untouched op (torch.add)": lambda: torch.add(a, a),
        "Python composite (F.softmax)": lambda: F.softmax(a, dim=-1),
    }
    n = CALLS
    out = {}
    for label, call in kinds.items():

        def measure(side: str, call=call) -> float:
            with region(side):
                call()  # the cast of w is cached from here on, in both regions
                start = clock()
                for _ in range(n):
                    call()
                return (clock() - start) / n * 1e6

        samples = interleaved(measure, SIDES, repeats)
        t = statistics.median(samples["torch"])
        out[label] = {side: added(samples, side) for side in SIDES[1:]}
        print(
            f"  {label:30s} torch {t:6.2f} us   "
            + "   ".join(f"{side} {out[label][side]:+6.2f}" for side in SIDES[1:])
        )
    return out


def per_region(repeats: int) -> dict[str, float]:
    """Added microseconds per enter+exit of a region with a non-default policy."""
    n = CALLS
    make = {
        "torch": lambda: torch.autocast(DEVICE),
        "engine": lambda: amped.autocast(DEVICE, policy=CHANGED),
        "module": lambda: amped.autocast(DEVICE, policy=MODULE_RULE),
        "fast": lambda: amped.autocast(DEVICE, policy=CHANGED),
        "pyop": lambda: amped.autocast(DEVICE, policy=PYTHON_OP),
    }

    def measure(side: str) -> float:
        new = make[side]
        with forced_path(EnginePath.MODE) if side == "engine" else contextlib.nullcontext():
            start = clock()
            for _ in range(n):
                with new():
                    pass
            return (clock() - start) / n * 1e6

    sides = tuple(side for side in ("torch", "engine", "module", "fast", "pyop") if side in SIDES)
    samples = interleaved(measure, sides, repeats)
    cost = {side: added(samples, side) for side in sides[1:]}
    print(
        f"  {'region enter+exit':30s} torch {statistics.median(samples['torch']):6.2f} us   "
        + "   ".join(f"{side} {cost[side]:+6.2f}" for side in sides[1:])
        + "   (construction included)"
    )
    return cost


def count_intercepted(
    model: nn.Module, run: Callable[[nn.Module], torch.Tensor], side: str = "engine"
) -> int:
    calls = 0
    original = AutocastMode.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        nonlocal calls
        calls += 1
        return original(self, func, types, args, kwargs)

    AutocastMode.__torch_function__ = counting  # type: ignore[method-assign]
    try:
        with region(side):
            run(model)
    finally:
        AutocastMode.__torch_function__ = original  # type: ignore[method-assign]
    return calls


def step_time(model, run, opt, side: str) -> float:
    start = clock()
    with region(side):
        loss = run(model)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return clock() - start


def paired(measure: Callable[[str], float], sides: tuple[str, ...], repeats: int):
    """side -> ratios to torch, one per block, and side -> its times (torch's included).

    A block times torch, the side, the side, torch, back to back (ABBA: a drift linear
    in time cancels), and its ratio is the side's two times over torch's two; the blocks
    rotate over the sides, ``repeats`` per side. Where kernels are registered or
    released (to or from "fast", "kernels", "pyop"), one untimed step runs first: that
    clears the dispatcher's caches, and in training the kernels stay from step to step."""
    ratios: dict[str, list[float]] = {side: [] for side in sides}
    times: dict[str, list[float]] = {side: [] for side in ("torch", *sides)}
    current = None
    for i in range(repeats):
        for side in orders(i, sides):
            block = []
            for s in ("torch", side, side, "torch"):
                if s != current:
                    prepare(s)
                    if {s, current} & set(KERNEL_SIDES):
                        measure(s)
                    current = s
                gc.collect()
                block.append(measure(s))
                times[s].append(block[-1])
            ratios[side].append((block[1] + block[2]) / (block[0] + block[3]))
    prepare("torch")
    return ratios, times


FEW_BLOCKS = 10
FEW_BLOCKS_NOTE = (
    "a bootstrap interval over fewer than 10 blocks understates the noise; "
    "do not judge 1.02 from it (use more repeats)"
)


def interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """A bootstrap interval of the median of ``values`` (2,000 resamples, seeded)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(2000))
    return medians[int(2000 * (1 - level) / 2)], medians[int(2000 * (1 + level) / 2) - 1]


def train_step(name: str, repeats: int) -> dict[str, list[float]]:
    """side -> the step's paired ratios to torch.autocast, one per ABBA block."""
    torch.manual_seed(0)
    model, run = MODELS[name]()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    for _ in range(2):  # warm-up every path
        for side in SIDES:
            step_time(model, run, opt, side)
    gc.collect()
    gc.freeze()  # the collection before each sample then sees only what is new
    try:
        ratios, times = paired(lambda side: step_time(model, run, opt, side), SIDES[1:], repeats)
    finally:
        gc.unfreeze()
    calls = count_intercepted(model, run)
    medians = {side: statistics.median(ratios[side]) for side in SIDES[1:]}
    per = added(times, "engine") / calls * 1e6
    print(
        f"  {name:8s} torch {statistics.median(times['torch']) * 1e3:8.2f} ms   ratio/torch: "
        + "   ".join(f"{side} {medians[side]:.3f}" for side in SIDES[1:])
        + f"   (intercepted calls/step: engine {calls}, {per:+.2f} us each)"
    )
    print(
        f"  {'':8s} 95 % interval of each median (bootstrap over {repeats} ABBA blocks): "
        + "   ".join("{} {:.3f}-{:.3f}".format(side, *interval(ratios[side])) for side in SIDES[1:])
    )
    return ratios


def compiled_policies() -> dict[str, amped.Policy]:
    """The compiled step's non-default policies, for the device in use."""
    return {
        # rules differ from torch's on one op these models never call: the engine's cost
        # around the very work torch.autocast compiles
        "engine": CHANGED,
        # a real module rule (norms in float32): the engine's hooks traced into every
        # module call, and float32 layer norms, which is more work than torch.autocast's
        "module": amped.Policy.preset("torch", DEVICE).with_module(nn.LayerNorm, "fp32"),
    }


def compiled_step(name: str, backend: str, repeats: int) -> dict[str, float]:
    """Ratios of a compiled training step, the region inside the compiled forward,
    compiled ``fullgraph=True`` (a graph break would run part of it eagerly)."""
    torch.manual_seed(0)
    model, run = encoder(layers=2) if name == "encoder" else MODELS[name]()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    policies = compiled_policies()

    def make(side: str):
        def forward_loss():
            if side == "torch":
                region = torch.autocast(DEVICE)
            else:  # "amped" is the default path: torch's C++ autocast, the control
                region = amped.autocast(DEVICE, policy=policies.get(side))
            with region:
                return run(model)

        return torch.compile(forward_loss, backend=backend, fullgraph=True)

    sides = ("torch", "engine", "module", "amped")
    compiled = {side: make(side) for side in sides}

    def measure(side: str) -> float:
        start = clock()
        loss = compiled[side]()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return clock() - start

    for side in sides:  # compile, then warm up
        for _ in range(3):
            measure(side)
    samples = interleaved(measure, sides, repeats)
    ratios = {side: ratio(samples, side) for side in sides[1:]}
    print(
        f"  {name:8s} ({backend}) torch {statistics.median(samples['torch']) * 1e3:8.2f} ms   "
        "ratio/torch: " + "   ".join(f"{side} {ratios[side]:.3f}" for side in sides[1:])
    )
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--compile-model", default="encoder", choices=list(MODELS))
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument("--calls", type=int, default=CALLS, help="calls per timed sample")
    args = parser.parse_args()
    set_device(args.device)
    set_calls(args.calls)
    torch.set_num_threads(1)
    if DEVICE == "cpu":
        print(f"torch {torch.__version__}, 1 thread, CPU bfloat16, thread CPU time, medians")
    else:
        print(
            f"torch {torch.__version__}, {torch.cuda.get_device_name()}, "
            f"{torch.get_autocast_dtype(DEVICE)}, synchronized wall time, medians"
        )
    print("per call (added to torch.autocast's time; target listed <= 5, untouched <= 0.5):")
    calls = per_call(max(5, args.repeats))
    print("per region (target <= 10):")
    region_cost = per_region(max(5, args.repeats))
    print("train step, eager (target <= 1.02):")
    if args.repeats < FEW_BLOCKS:
        print(f"  note: {args.repeats} ABBA blocks per side: {FEW_BLOCKS_NOTE}")
    blocks = {name: train_step(name, args.repeats) for name in args.models.split(",")}
    steps = {
        name: {side: statistics.median(values) for side, values in ratios.items()}
        for name, ratios in blocks.items()
    }
    compiled = None
    if not args.no_compile:
        print("train step, compiled forward (target <= 1.02):")
        compiled = compiled_step(args.compile_model, args.compile_backend, args.repeats)
    paths = tuple(side for side in ("engine", "module", "fast", "kernels", "pyop") if side in SIDES)
    print(f"summary ({' / '.join(paths)}):")
    for label, key, target in (
        ("listed op", "listed op (F.linear)", "us (target <= 5)"),
        ("untouched op", "untouched op (torch.add)", "us (target <= 0.5)"),
    ):
        got = " / ".join(f"{calls[key][side]:+.2f}" for side in paths)
        print(f"  {label:13s} {got} {target}")
    got = " / ".join(f"{cost:+.2f}" for cost in region_cost.values())
    print(f"  region        {got} us (target <= 10; {' / '.join(region_cost)})")
    for name, value in steps.items():
        got = " / ".join(
            "{:.3f} ({:.3f}-{:.3f})".format(value[side], *interval(blocks[name][side]))
            for side in paths
        )
        print(f"  {name:13s} {got} (target <= 1.02; 95 % interval in brackets)")
    if compiled is not None:
        print(
            f"  compiled      {compiled['engine']:.3f} (target <= 1.02); module rule "
            f"{compiled['module']:.3f}, control {compiled['amped']:.3f}"
        )
    if args.json:
        figures = {
            "per_call_us": calls,
            "per_region_us": region_cost,
            "train_step_ratio": steps,  # medians of the blocks' ratios
            "train_step_blocks": blocks,  # every ABBA block's ratio, to compare two trees
        }
        Path(args.json).write_text(
            to_json({"device": DEVICE, **figures, "compiled_ratio": compiled})
        )


if __name__ == "__main__":
    main()
