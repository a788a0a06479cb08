"""amped's emulated FP8 and block GEMMs against torchao's, on the same layers, one process.

A stack Linear(d, 4d) -> GELU -> Linear(4d, d) (d = ``--dim``, 256), ``--tokens`` (1,024)
bfloat16 tokens, forward and backward (the input requires grad, so every layer runs its
three GEMMs), no autocast, no optimizer. Variants, each on its own copy of the same
weights, all in bfloat16 but the first (torchao's MX layer takes one dtype):

- ``float32``: the stack in float32, float32 input (the baseline of "vs float32");
- ``bf16``: the stack in bfloat16;
- ``amped <recipe>``: both Linears converted by ``amped.lowp.convert_to_low_precision`` (emulated
  GEMMs, the casts compiled as in training), for fp8-tensorwise, fp8-rowwise, mxfp8,
  mxfp4 and nvfp4; with ``--gemm both`` each twice, its emulated GEMMs forced to
  bfloat16 (``[bf16]``: the kernel amped used on every machine before it chose) and
  chosen automatically (``[auto]``), in the same run;
- ``torchao float8 tensorwise / rowwise``: ``convert_to_float8_training`` (torch's CPU
  ``_scaled_mm``), and ``torchao mxfp8``: its ``MXFP8Linear`` with the emulated kernel.

Variants run interleaved one step at a time, the order rotating every repeat; the
figure is the median over repeats. Printed: ms per step, the ratio to float32 and,
for amped's FP8 and MX recipes, to torchao's same recipe (median of per-repeat ratios).

**An AVX2 CPU, emulated.** ``--isa avx2`` reruns this script in a subprocess with the
instruction sets capped at AVX2: ``ONEDNN_MAX_CPU_ISA=AVX2`` (oneDNN: its bfloat16
matmul, which needs AVX512, falls back to torch's scalar code, as on an AVX2 CPU),
``ATEN_CPU_CAPABILITY=avx2`` (torch's vectorized kernels and Inductor's generated code
use 256-bit AVX2), ``TORCHINDUCTOR_CPP_MARCH=haswell`` (the C++ compiler may not use
AVX512 or AVX512-BF16 instructions in the compiled casts) and
``MKL_ENABLE_INSTRUCTIONS=AVX2`` (MKL's float32 GEMM). The script prints a bfloat16
and a float32 matmul's time first, to show the cap took (bfloat16 some 10-50x slower).

Usage: python benchmarks/emulation_vs_torchao.py [--threads 1] [--repeats 7] [--steps 2]
           [--dim 256] [--tokens 1024] [--gemm auto|bf16|float32|both] [--isa native|avx2]
           [--recipes fp8-tensorwise,fp8-rowwise,mxfp8,mxfp4,nvfp4] [--no-torchao]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn as nn
from block_formats import interleaved  # benchmarks/, next to this script

import amped
from amped.comparison.environment import cpu_name
from amped.lowp.convert import convert_layers
from amped.lowp.float8.config import FLOAT8_CONFIGS
from amped.lowp.mx.block_config import BLOCK_CONFIGS

try:
    from amped.lowp.float8.emulated_gemm import emulated_gemm, set_emulated_gemm
except ImportError:  # an amped from before the choice (bf16 GEMMs): --gemm auto only
    emulated_gemm = set_emulated_gemm = None  # type: ignore[assignment]

AVX2_ENV = {
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "TORCHINDUCTOR_CPP_MARCH": "haswell",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}
RECIPES = ("fp8-tensorwise", "fp8-rowwise", "mxfp8", "mxfp4", "nvfp4")
TORCHAO_OF = {"fp8-tensorwise": "tensorwise", "fp8-rowwise": "rowwise", "mxfp8": "mxfp8"}


def stack(dim: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))


def amped_model(base: nn.Module, recipe: str) -> nn.Module:
    model = copy.deepcopy(base)
    scaling = recipe.removeprefix("fp8-")
    config = FLOAT8_CONFIGS[scaling] if recipe.startswith("fp8-") else BLOCK_CONFIGS[recipe]
    convert_layers(model, config, ["0", "2"])
    return model


def torchao_model(base: nn.Module, recipe: str) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
    model = copy.deepcopy(base)
    if recipe != "mxfp8":
        config = Float8LinearConfig.from_recipe_name(recipe)
        return convert_to_float8_training(model, config=config)
    for index in (0, 2):
        old = model[index]
        new = MXFP8Linear(
            old.in_features,
            old.out_features,
            kernel_preference=KernelPreference.EMULATED,
            dtype=old.weight.dtype,
        )
        new.load_state_dict(old.state_dict())
        model[index] = new
    return model


def stepper(
    model: nn.Module, x: torch.Tensor, grad: torch.Tensor, gemm: str | None = None
) -> Callable[[], None]:
    """One forward and backward of ``model``; ``gemm``: amped's emulated GEMMs forced to
    that choice for this variant's steps."""

    def step() -> None:
        forced = gemm is not None and set_emulated_gemm is not None
        previous = set_emulated_gemm(gemm) if forced else None  # type: ignore[misc, arg-type]
        try:
            inp = x.detach().requires_grad_()
            model(inp).backward(grad)
            for p in model.parameters():
                p.grad = None
        finally:
            if forced:
                set_emulated_gemm(previous)  # type: ignore[misc]

    return step


def matmul_ms(dtype: torch.dtype, n: int = 256) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    times = []
    for _ in range(5):
        began = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


def variants(args: argparse.Namespace) -> dict[str, Callable[[], None]]:
    base = stack(args.dim)
    torch.manual_seed(1)
    x = torch.randn(args.tokens, args.dim)
    grad = torch.randn(args.tokens, args.dim) * 1e-2
    xb, gb = x.to(torch.bfloat16), grad.to(torch.bfloat16)
    low = copy.deepcopy(base).to(torch.bfloat16)  # torchao's MX layer wants one dtype
    steps = {
        "float32": stepper(copy.deepcopy(base), x, grad),
        "bf16": stepper(copy.deepcopy(low), xb, gb),
    }
    gemms = {"both": ["bf16", "auto"]}.get(args.gemm, [args.gemm])
    for recipe in args.recipes:
        for gemm in gemms:
            name = f"amped {recipe}" + (f" [{gemm}]" if len(gemms) > 1 else "")
            steps[name] = stepper(amped_model(low, recipe), xb, gb, gemm)
    if not args.no_torchao:
        for recipe in ("tensorwise", "rowwise", "mxfp8"):
            steps[f"torchao {recipe}"] = stepper(torchao_model(low, recipe), xb, gb)
    return steps


def report(times: dict[str, list[float]], steps: int) -> None:
    ms = {name: statistics.median(t) / steps * 1e3 for name, t in times.items()}

    def vs(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))

    print(f"{'variant':<30} {'ms':>8} {'vs float32':>11} {'vs torchao':>11}")
    for name in times:
        recipe = name.removeprefix("amped ").split(" [")[0]
        ao = f"torchao {TORCHAO_OF[recipe]}" if recipe in TORCHAO_OF else None
        against = f"{vs(name, ao):10.2f}x" if name.startswith("amped") and ao in times else ""
        print(f"{name:<30} {ms[name]:8.1f} {vs(name, 'float32'):10.2f}x {against:>11}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--gemm", choices=["auto", "bf16", "float32", "both"], default="both")
    parser.add_argument("--isa", choices=["native", "avx2"], default="native")
    parser.add_argument("--recipes", type=lambda s: s.split(","), default=list(RECIPES))
    parser.add_argument("--no-torchao", action="store_true")
    args = parser.parse_args()
    if args.isa == "avx2" and os.environ.get("ONEDNN_MAX_CPU_ISA") != "AVX2":
        argv = [a for a in sys.argv[1:] if a not in ("--isa=avx2",)]
        if "--isa" in argv:
            i = argv.index("--isa")
            del argv[i : i + 2]
        env = os.environ | AVX2_ENV
        command = [sys.executable, "-u", __file__, *argv, "--isa", "avx2"]
        sys.exit(subprocess.call(command, env=env))
    torch.set_num_threads(args.threads)
    if emulated_gemm is None and args.gemm != "auto":
        parser.error(f"this amped ({amped.__file__}) has no emulated GEMM choice: --gemm auto")
    choice = emulated_gemm("cpu") if emulated_gemm is not None else None
    said = f"{choice.dtype} ({choice.reason})" if choice else "bfloat16 (amped before the choice)"
    print(f"CPU: {cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    print(f"ISA: {args.isa} " + " ".join(f"{k}={os.environ.get(k, '-')}" for k in AVX2_ENV))
    print(f"torch cpu capability {torch.backends.cpu.get_cpu_capability()}; amped "
          f"{amped.__file__}; its emulated GEMMs (auto): {said}")  # fmt: skip
    bf16, fp32 = matmul_ms(torch.bfloat16), matmul_ms(torch.float32)
    print(f"256^3 matmul: bfloat16 {bf16:.2f} ms, float32 {fp32:.2f} ms ({bf16 / fp32:.1f}x)")
    print(
        f"stack: Linear({args.dim},{4 * args.dim}) GELU Linear({4 * args.dim},{args.dim}), "
        f"{args.tokens} tokens, forward+backward; median of {args.repeats} repeats of "
        f"{args.steps} steps; load before {os.getloadavg()}"
    )
    times = interleaved(variants(args), args.repeats, args.steps, lambda: None)
    report(times, args.steps)
    print(f"load after {os.getloadavg()}")


if __name__ == "__main__":
    main()
