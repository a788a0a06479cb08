"""Train-step time under amped.autocast divided by the same under torch.autocast.

CPU, bfloat16, forward + backward + optimizer step, the two measured side by side in
one process and interleaved (torch, amped, amped, torch, ...), median of the per-pair
ratios. With the default policy amped leaves the casts to torch's C++ autocast (the
rules are torch's own), so "amped" should cost what torch does; "amped engine" forces
amped's Python engine on the same policy (``amped.autocast_mode.engine_always``): what any
policy that changes a rule costs. Also prints how many calls the engine intercepts per
step and the microseconds each adds on average.

    python benchmarks/autocast_overhead.py [--repeats 30] [--models encoder,gpt2,cnn]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import amped
from amped.autocast_mode import engine_always
from amped.autocast_mode.mode import AutocastMode

SIDES = ("torch", "amped", "amped engine")


@contextlib.contextmanager
def amped_engine():
    """amped.autocast with the default policy, through amped's Python engine."""
    with engine_always(), amped.autocast("cpu"):
        yield


def region(side: str) -> contextlib.AbstractContextManager:
    if side == "torch":
        return torch.autocast("cpu")
    return amped.autocast("cpu") if side == "amped" else amped_engine()


def encoder() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    layer = nn.TransformerEncoderLayer(256, 8, 1024, dropout=0.1, batch_first=True)
    model = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False).train()
    x = torch.randn(8, 32, 256)
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
    model = GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 1024, (4, 64))
    return model, lambda m: m(input_ids=ids, labels=ids).loss


def cnn() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10),
    ).train()  # fmt: skip
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    return model, lambda m: F.cross_entropy(m(x), y)


MODELS = {"encoder": encoder, "gpt2": gpt2, "cnn": cnn}


def step_time(model, run, opt, region) -> float:
    start = time.perf_counter()
    with region:
        loss = run(model)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def count_intercepted(model, run) -> int:
    calls = 0
    original = AutocastMode.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        nonlocal calls
        calls += 1
        return original(self, func, types, args, kwargs)

    AutocastMode.__torch_function__ = counting  # type: ignore[method-assign]
    try:
        with amped_engine():
            run(model)
    finally:
        AutocastMode.__torch_function__ = original  # type: ignore[method-assign]
    return calls


def measure(name: str, repeats: int) -> None:
    torch.manual_seed(0)
    model, run = MODELS[name]()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    for _ in range(3):  # warm-up every path
        for side in SIDES:
            step_time(model, run, opt, region(side))
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    for i in range(repeats):
        order = SIDES[i % len(SIDES) :] + SIDES[: i % len(SIDES)]
        for side in order:
            times[side].append(step_time(model, run, opt, region(side)))

    def ratio(side: str) -> float:
        pairs = zip(times[side], times["torch"], strict=True)
        return statistics.median(a / t for a, t in pairs)

    medians = {side: statistics.median(times[side]) * 1e3 for side in SIDES}
    calls = count_intercepted(model, run)
    diffs = [a - t for a, t in zip(times["amped engine"], times["torch"], strict=True)]
    per_call = statistics.median(diffs) / calls * 1e6  # noisy: the step is ~1000x longer
    print(
        f"{name:8s} torch {medians['torch']:8.2f} ms  amped {medians['amped']:8.2f} ms  "
        f"engine {medians['amped engine']:8.2f} ms  ratio amped/torch = "
        f"{ratio('amped'):.3f}, engine/torch = {ratio('amped engine'):.3f}  "
        f"(engine: intercepted calls/step {calls}, {per_call:+.2f} us each)"
    )


def per_call_overhead(repeats: int) -> None:
    """Microseconds one call costs under each region, for the kinds of call the engine sees."""
    a, w = torch.randn(8, 8), torch.randn(8, 8, requires_grad=True)
    kinds = {
        "listed op (F.linear)": lambda: F.linear(a, w),
        "unlisted op (torch.add)": lambda: torch.add(a, a),
        "Python composite (F.softmax)": lambda: F.softmax(a, dim=-1),
        "attribute (Tensor.shape)": lambda: a.shape,
    }
    n = 2000
    for label, call in kinds.items():
        samples: dict[str, list[float]] = {side: [] for side in SIDES}
        for i in range(repeats):
            for side in SIDES[i % len(SIDES) :] + SIDES[: i % len(SIDES)]:
                with region(side):
                    start = time.perf_counter()
                    for _ in range(n):
                        call()
                    samples[side].append((time.perf_counter() - start) / n * 1e6)
        t, a_, e = (statistics.median(samples[side]) for side in SIDES)
        print(f"  {label:30s} torch {t:6.2f} us  amped {a_ - t:+6.2f} us  engine {e - t:+6.2f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU bfloat16")
    for name in args.models.split(","):
        measure(name, args.repeats)
    print("per call:")
    per_call_overhead(max(5, args.repeats // 3))


if __name__ == "__main__":
    main()
