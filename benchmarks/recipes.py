"""Memory and step time of the weight-changing recipes against torch.autocast (O1), CPU bf16.

Two models: a 4-layer ``nn.TransformerEncoder`` (d=256, 4 heads, feed-forward 1024)
and a tiny GPT-2 (transformers ``GPT2Config``: 4 layers, d=256, 4 heads, 2048-token
vocabulary), batch 4 x sequence 32, AdamW.

1. **Bytes per parameter** (``amped.memory_report`` after one step) for fp32,
   bf16-mixed (torch.amp's O1 layout), bf16-master, bf16-pure and bf16-pure-sr.
2. **Train-step time** (forward, backward, optimizer step, zero_grad) of bf16-master
   and bf16-pure relative to a plain torch loop under ``torch.autocast("cpu",
   bfloat16)`` with float32 weights and ``torch.optim.AdamW``. Each variant has its
   own copy of the model (same initial weights). The variants run side by side in one
   process, interleaved one step at a time (the order rotating every repeat); the
   printed ratio is the median over repeats of ``time(variant) / time(O1)``.
   amped's own bf16-mixed (O1 through ``amped.prepare``) is timed too: with torch's
   rules its autocast is torch's C++ one, so it shows what the setup itself costs.
   The O2 recipes keep norms in float32 by hooks on those modules (no rule in the
   region's policy: the region is torch's C++ autocast too), and step the float32
   masters with the fused master-weight step (one compiled kernel a chunk; compiled
   in the warm-up steps).
3. **What skipping the casts alone can save.** Interleaved with the steps, the work
   torch O1 does per step and O2 does not is timed on its own: each float32 weight
   cast to bfloat16 (the forward's casts) and each bfloat16 weight gradient cast back
   to float32 (their backward). ``1 - casts / step`` is the ratio a recipe with
   low-precision weights reaches by skipping them, all else equal. O2's fused step also
   replaces torch's per-tensor AdamW (about ten passes over memory a tensor) by one
   pass, so bf16-master can go below that bound; the unfused O2 step (casts to and
   from float32 masters in passes of their own) stayed above it.
   The speed targets are printed beside the ratios: bf16-master / torch O1 at most
   0.96 at one thread and at most 1.00 at all threads.
5. With ``--fp16``: the same for ``fp16-master`` against torch O1 in float16
   (``torch.autocast(dtype=torch.float16)`` with ``torch.amp.GradScaler``), where the
   CPU has float16 matmul kernels (AVX512-FP16; without them float16 is far slower
   than float32 and the comparison says little).

The skipped casts' share, and with it what O2 can gain, grows as the matmuls shrink:
``--batch`` and ``--seq`` change the input (the figures in docs/benchmarks.md are at 4 x 32).

On CUDA (``--device cuda``) the models, data and autocast are on the GPU and each timed
step ends with ``torch.cuda.synchronize()``. ``--json PATH`` also writes the figures to
a file (for ``benchmarks/support/gpu_check.py``); ``--models`` picks models by their key.

4. With ``--phases``: where bf16-pure's step time goes. torch O1 and bf16-pure run
   again, interleaved, each step timed in three parts: forward, backward, and the
   optimizer step with zero_grad; the ratios are medians over repeats, per part.

Usage: python benchmarks/recipes.py [--repeats 10] [--warmup 2] [--threads N]
                                    [--batch 4] [--seq 32] [--models encoder,gpt2]
                                    [--device cpu] [--json PATH] [--phases] [--fp16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn
from support.device_sync import synchronize

import amped
from amped._internal.jsonio import to_json
from amped.comparison.environment import cpu_name

BATCH, SEQ = 4, 32
MEMORY_RECIPES = ("fp32", "bf16-mixed", "bf16-master", "bf16-pure", "bf16-pure-sr")
TIMED = ("amped bf16-mixed", "bf16-master", "bf16-pure")
DEVICE = "cpu"

Loss = Callable[[nn.Module], torch.Tensor]


def set_input(batch: int, seq: int) -> None:
    """Set the input size the model factories build their data for."""
    global BATCH, SEQ
    BATCH, SEQ = batch, seq


def set_device(device: str) -> None:
    """Set the device the model factories build their models and data on."""
    global DEVICE
    DEVICE = device


def encoder() -> tuple[nn.Module, Loss]:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(256, 4, dim_feedforward=1024, batch_first=True)
    model = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False).to(DEVICE)
    x = torch.randn(BATCH, SEQ, 256, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    return model, lambda m: m(x).float().pow(2).mean()


def gpt2() -> tuple[nn.Module, Loss]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=4,
        n_embd=256,
        n_head=4,
        n_positions=64,
        vocab_size=2048,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="sdpa",
    )
    ids = torch.randint(0, 2048, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    ids = ids.to(DEVICE)
    return GPT2LMHeadModel(config).to(DEVICE), lambda m: m(input_ids=ids, labels=ids).loss


MODELS = {"TransformerEncoder d=256 x4": encoder, "GPT-2 tiny d=256 x4": gpt2}
KEYS = {"encoder": "TransformerEncoder d=256 x4", "gpt2": "GPT-2 tiny d=256 x4"}


class TorchO1:
    """The baseline: float32 weights and AdamW, forward under torch.autocast (float16:
    with torch's GradScaler)."""

    def __init__(self, model: nn.Module, loss: Loss, dtype: torch.dtype = torch.bfloat16) -> None:
        self.model, self.loss, self.dtype = model, loss, dtype
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.scaler = torch.amp.GradScaler(DEVICE) if dtype is torch.float16 else None

    def forward(self) -> torch.Tensor:
        with torch.autocast(DEVICE, dtype=self.dtype):
            return self.loss(self.model)

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def optimizer_step(self) -> None:
        if self.scaler is None:
            self.optimizer.step()
        else:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> None:
        self.backward(self.forward())
        self.optimizer_step()


class Recipe(TorchO1):
    """One amped recipe through amped.prepare and the setup's loop."""

    def __init__(self, model: nn.Module, loss: Loss, recipe: str) -> None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.setup = amped.prepare(model, optimizer, recipe)
        self.loss = loss

    def forward(self) -> torch.Tensor:
        with self.setup.autocast():
            return self.loss(self.setup.model)

    def backward(self, loss: torch.Tensor) -> None:
        self.setup.backward(loss)

    def optimizer_step(self) -> None:
        self.setup.step()
        self.setup.zero_grad()


def phases(side: TorchO1) -> tuple[float, float, float]:
    """One step of ``side``, timed in parts: forward, backward, optimizer with zero_grad."""
    synchronize(DEVICE)
    start = time.perf_counter()
    loss = side.forward()
    synchronize(DEVICE)
    forward = time.perf_counter()
    side.backward(loss)
    synchronize(DEVICE)
    backward = time.perf_counter()
    side.optimizer_step()
    synchronize(DEVICE)
    return forward - start, backward - forward, time.perf_counter() - backward


def memory_rows(make: Callable[[], tuple[nn.Module, Loss]]) -> dict[str, tuple[float, float]]:
    """Bytes per parameter between steps, and at the step's peak, per recipe."""
    rows = {}
    for recipe in MEMORY_RECIPES:
        model, loss = make()
        side = Recipe(model, loss, recipe)
        side.step()  # AdamW builds its state at the first step
        report = amped.memory_report(model, side.setup.optimizer)
        rows[recipe] = (report.bytes_per_param, report.per_param(report.peak))
    return rows


def timed(step: Callable[[], None]) -> float:
    synchronize(DEVICE)
    start = time.perf_counter()
    step()
    synchronize(DEVICE)
    return time.perf_counter() - start


class WeightCasts:
    """What torch O1 does per step that a low-precision-weight recipe skips."""

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> None:
        self.weights = [p.detach() for p in model.parameters()]
        self.grads = [torch.randn_like(w, dtype=dtype) for w in self.weights]
        self.dtype = dtype

    def step(self) -> None:
        for weight in self.weights:
            weight.to(self.dtype)
        for grad in self.grads:
            grad.to(torch.float32)


def time_ratios(
    make: Callable[[], tuple[nn.Module, Loss]],
    repeats: int,
    warmup: int,
    dtype: torch.dtype = torch.bfloat16,
):
    """Median step time of torch O1, and the median ratio to it of each timed side."""
    baseline = TorchO1(*make(), dtype)
    sides: dict[str, TorchO1 | Recipe | WeightCasts] = {
        "torch O1": baseline,
        "casts": WeightCasts(baseline.model, dtype),
    }
    for name in TIMED if dtype is torch.bfloat16 else ("fp16-master",):
        recipe = name.removeprefix("amped ")
        sides[name] = Recipe(*make(), recipe)
    names = list(sides)
    for _ in range(warmup):
        for name in names:
            sides[name].step()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            times[name].append(timed(sides[name].step))
    base = times["torch O1"]
    ratios = {
        name: statistics.median(t / b for t, b in zip(times[name], base, strict=True))
        for name in names[1:]
    }
    return statistics.median(base), ratios


PHASES = ("forward", "backward", "optimizer")


def phase_ratios(make: Callable[[], tuple[nn.Module, Loss]], repeats: int, warmup: int):
    """Median phase times of torch O1 and bf16-pure, interleaved, and their ratios."""
    sides: dict[str, TorchO1] = {
        "torch O1": TorchO1(*make()),
        "bf16-pure": Recipe(*make(), "bf16-pure"),
    }
    for _ in range(warmup):
        for side in sides.values():
            side.step()
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in sides}
    for r in range(repeats):
        for name in list(sides)[r % 2 :] + list(sides)[: r % 2]:
            times[name].append(phases(sides[name]))
    medians = {
        name: [statistics.median(t[i] for t in rows) for i in range(3)]
        for name, rows in times.items()
    }
    ratios = [
        statistics.median(
            p[i] / o[i] for p, o in zip(times["bf16-pure"], times["torch O1"], strict=True)
        )
        for i in range(3)
    ]
    return medians, ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--seq", type=int, default=SEQ)
    parser.add_argument("--models", default=",".join(KEYS), help="keys: encoder, gpt2")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument(
        "--phases", action="store_true", help="also time forward, backward and optimizer"
    )
    parser.add_argument("--fp16", action="store_true", help="also fp16-master against fp16 O1")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    set_input(args.batch, args.seq)
    set_device(args.device)
    print(f"torch {torch.__version__}, {args.threads} threads, batch {BATCH} x seq {SEQ}, AdamW")
    print(f"CPU: {cpu_name()} ({os.cpu_count()} cores); load average {load()} at the start")
    if DEVICE != "cpu":
        print(f"device: {torch.cuda.get_device_name()}, steps timed to torch.cuda.synchronize()")
    figures = {}
    for label, make in ((KEYS[key], MODELS[KEYS[key]]) for key in args.models.split(",")):
        print(f"\n{label}")
        print("  bytes/param, AdamW        between steps   in the step")
        memory = memory_rows(make)
        for recipe, (total, peak) in memory.items():
            print(f"  {recipe:<24} {total:14.2f} {peak:13.2f}")
        print("  (torch O1 = bf16-mixed, plus a bf16 copy of each weight during the forward)")
        base, ratios = time_ratios(make, args.repeats, args.warmup)
        figures[label] = {"bytes_per_param": memory, "o1_step_s": base, "ratios": dict(ratios)}
        casts = ratios.pop("casts")
        print(f"  step time torch O1 (median)  {base * 1e3:8.1f} ms")
        print_ratios(ratios, casts, args.threads, "bf16-master")
        if args.fp16:
            base16, ratios16 = time_ratios(make, args.repeats, args.warmup, torch.float16)
            figures[label]["fp16"] = {"o1_step_s": base16, "ratios": dict(ratios16)}
            casts16 = ratios16.pop("casts")
            print(
                f"  step time torch O1 in float16, with GradScaler (median)  {base16 * 1e3:.1f} ms"
            )
            print_ratios(ratios16, casts16, args.threads, "fp16-master", " (fp16 O1)")
        if args.phases:
            medians, phase = phase_ratios(make, args.repeats, args.warmup)
            for name, times in medians.items():
                line = ", ".join(f"{p} {t * 1e3:.1f}" for p, t in zip(PHASES, times, strict=True))
                print(f"  {name} phases (ms): {line}")
            line = ", ".join(f"{p} {r:.3f}" for p, r in zip(PHASES, phase, strict=True))
            print(f"  ratio bf16-pure/torch O1 per phase: {line}")
    print(f"\nload average {load()} at the end (other work on the machine moves the ratios)")
    if args.json:
        Path(args.json).write_text(
            to_json({"device": DEVICE, "batch": BATCH, "seq": SEQ, "models": figures})
        )


def print_ratios(
    ratios: dict[str, float], casts: float, threads: int, target: str, peer: str = ""
) -> None:
    """Each side's ratio; the speed target beside ``target``'s; the casts' bound."""
    bound = 0.96 if threads == 1 else 1.00
    for name, ratio in ratios.items():
        note = ""
        if name == target:
            verdict = "met" if ratio <= bound else "NOT met"
            note = f"   (target <= {bound:.2f} at {threads} thread(s): {verdict})"
        print(f"  ratio {name}/torch O1{peer} = {ratio:.3f}{note}")
    print(
        f"  weight casts in the O1 step: {casts:.1%} of it; skipping them alone gives "
        f"{1 - casts:.3f} (the fused O2 step also beats torch's per-tensor AdamW)"
    )


def load() -> str:
    """The 1, 5 and 15 minute load averages, as uptime prints them."""
    try:
        return ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
