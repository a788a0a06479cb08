"""amped's FP8 and block recipes against torchao on the same layers, side by side.

Every part times a stack of Linear(d, 4d) -> GELU -> Linear(4d, d) blocks (d = ``--dim``)
against torchao's same recipes, each variant on its own copy of the same weights, in one
process: variants run interleaved one step at a time with the order rotating every
repeat, and a figure is the median over repeats. Two subcommands, one per question:

**step** (the FP8 recipes' train step). CPU (always, unless ``--gpu-only``): a stack of
``--layers`` blocks, ``--tokens`` bfloat16 tokens, SGD. One train step is forward,
backward, optimizer step and zero_grad; the printed figure is the median over repeats of
``time(amped) / time(torchao)`` (target <= 1.05):

- ``amped scaled_mm``: amped's layer calling ``torch._scaled_mm`` as torchao does
  (``emulate=False``) - the like-for-like comparison;
- ``amped emulated``: amped's CPU default, its exact float32 emulation.

Both sides run with oneDNN off (``torch.backends.mkldnn.flags(enabled=False)``): on
AMX-INT8 CPUs torch sends e4m3 x e4m3 ``_scaled_mm`` to oneDNN, which on the machine
these figures came from took seconds per GEMM; with it off, torch runs its reference
CPU kernel (dequantize, float32 matmul), for amped and torchao alike. fp8-delayed has
no torchao counterpart (torchao removed delayed scaling): it is timed against torchao's
tensorwise recipe, the closest one.

GPU (only on a CUDA device of compute capability >= 8.9; skipped otherwise): a stack
of large Linear layers (``--gpu-dim``, default 8192, ``--gpu-tokens`` 16384), each FP8
recipe against bf16-mixed (target >= 1.3x) and against torchao's same recipe (<= 1.05;
left out, with a line, where torchao does not import). :func:`run_gpu` is importable for
a one-call GPU script; ``--json PATH`` also writes the figures to a file (for
``benchmarks/support/gpu_check.py``). Then, on sm100-class GPUs only, the block recipes with
native block GEMMs against bf16-mixed (``benchmarks/block_formats.py``'s GPU part,
same sizes; ``gpu_block`` in the JSON, None elsewhere).

**layers** (the emulated FP8 and block GEMMs, forward and backward, CPU). One block
(``--dim`` 256), ``--tokens`` (1,024) bfloat16 tokens, forward and backward (the input
requires grad, so every layer runs its three GEMMs), no autocast, no optimizer.
Variants, all in bfloat16 but the first (torchao's MX layer takes one dtype):

- ``float32``: the stack in float32, float32 input (the baseline of "vs float32");
- ``bf16``: the stack in bfloat16;
- ``amped <recipe>``: both Linears converted by ``amped.lowp.convert_to_low_precision`` (emulated
  GEMMs, the casts compiled as in training), for fp8-tensorwise, fp8-rowwise, mxfp8,
  mxfp4 and nvfp4; with ``--gemm both`` each twice, its emulated GEMMs forced to
  bfloat16 (``[bf16]``: the kernel amped used on every machine before it chose) and
  chosen automatically (``[auto]``), in the same run;
- ``torchao float8 tensorwise / rowwise``: ``convert_to_float8_training`` (torch's CPU
  ``_scaled_mm``), and ``torchao mxfp8``: its ``MXFP8Linear`` with the emulated kernel.

Printed: ms per step, the ratio to float32 and, for amped's FP8 and MX recipes, to
torchao's same recipe (median of per-repeat ratios).

*An AVX2 CPU, emulated.* ``layers --isa avx2`` reruns this script in a subprocess with
the instruction sets capped at AVX2: ``ONEDNN_MAX_CPU_ISA=AVX2`` (oneDNN: its bfloat16
matmul, which needs AVX512, falls back to torch's scalar code, as on an AVX2 CPU),
``ATEN_CPU_CAPABILITY=avx2`` (torch's vectorized kernels and Inductor's generated code
use 256-bit AVX2), ``TORCHINDUCTOR_CPP_MARCH=haswell`` (the C++ compiler may not use
AVX512 or AVX512-BF16 instructions in the compiled casts) and
``MKL_ENABLE_INSTRUCTIONS=AVX2`` (MKL's float32 GEMM). The script prints a bfloat16
and a float32 matmul's time first, to show the cap took (bfloat16 some 10-50x slower).

Usage:
    python benchmarks/fp8.py step [--repeats 9] [--steps 3] [--dim 256] [--layers 2]
                                  [--tokens 512] [--threads N] [--gpu-only]
                                  [--gpu-dim 8192] [--gpu-layers 4] [--gpu-tokens 16384]
                                  [--gpu-repeats 7] [--gpu-steps 5] [--json PATH]
    python benchmarks/fp8.py layers [--threads 1] [--repeats 7] [--steps 2] [--dim 256]
                                    [--tokens 1024] [--gemm auto|bf16|float32|both]
                                    [--isa native|avx2] [--no-torchao]
                                    [--recipes fp8-tensorwise,fp8-rowwise,mxfp8,mxfp4,nvfp4]
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
from pathlib import Path

import block_formats  # benchmarks/, next to this script
import torch
import torch.nn as nn
from block_formats import interleaved, ratio  # one timing loop for both benchmarks

import amped
from amped._internal.jsonio import to_json
from amped.comparison.environment import cpu_name
from amped.lowp.convert import convert_layers
from amped.lowp.float8.config import FLOAT8_CONFIGS
from amped.lowp.float8.delayed import update_delayed_scaling
from amped.lowp.mx.block_config import BLOCK_CONFIGS

try:
    from amped.lowp.float8.emulated_gemm import emulated_gemm, set_emulated_gemm
except ImportError:  # an amped from before the choice (bf16 GEMMs): layers --gemm auto only
    emulated_gemm = set_emulated_gemm = None  # type: ignore[assignment]

FP8_SCALINGS = ("tensorwise", "rowwise", "rowwise-gw-hp", "delayed")
LAYER_RECIPES = ("fp8-tensorwise", "fp8-rowwise", "mxfp8", "mxfp4", "nvfp4")
# torchao's same recipe (torchao has no delayed scaling: ``step`` times fp8-delayed
# against torchao's tensorwise).
TORCHAO_OF = {
    "fp8-tensorwise": "tensorwise",
    "fp8-rowwise": "rowwise",
    "fp8-rowwise-gw-hp": "rowwise_with_gw_hp",
    "mxfp8": "mxfp8",
}
AVX2_ENV = {
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "TORCHINDUCTOR_CPP_MARCH": "haswell",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}


def stack(dim: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)]
    return nn.Sequential(*blocks)


def amped_model(model: nn.Module, recipe: str, emulate: bool | None = None) -> nn.Module:
    """A copy of ``model`` with every Linear converted to ``recipe`` (fp8-* or a block one)."""
    ours = copy.deepcopy(model)
    names = [n for n, m in ours.named_modules() if isinstance(m, nn.Linear)]
    scaling = recipe.removeprefix("fp8-")
    config = FLOAT8_CONFIGS[scaling] if recipe.startswith("fp8-") else BLOCK_CONFIGS[recipe]
    convert_layers(ours, config, names, emulate=emulate)
    return ours


def torchao_model(model: nn.Module, recipe: str) -> nn.Module:
    """A copy of ``model`` in torchao's ``recipe`` (a Float8LinearConfig recipe name, or
    ``mxfp8``: its MXFP8Linear with the emulated kernel)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    model = copy.deepcopy(model)
    if recipe != "mxfp8":
        config = Float8LinearConfig.from_recipe_name(recipe)
        return convert_to_float8_training(model, config=config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
    for name, old in list(model.named_children()):
        if isinstance(old, nn.Linear):
            new = MXFP8Linear(
                old.in_features,
                old.out_features,
                kernel_preference=KernelPreference.EMULATED,
                dtype=old.weight.dtype,
            )
            new.load_state_dict(old.state_dict())
            setattr(model, name, new)
    return model


def torchao_missing() -> str | None:
    """Why torchao's float8 training cannot be imported here, or None if it can."""
    try:
        torchao_model(nn.Linear(16, 16), "tensorwise")
    except Exception as error:  # an old or mismatched torchao fails in many ways
        return f"{type(error).__name__}: {error}"
    return None


# --- step: the FP8 recipes' train step -------------------------------------------------


def torchao_of(recipe: str) -> str:
    """torchao's recipe that amped's FP8 ``recipe`` is timed against."""
    return TORCHAO_OF["fp8-tensorwise" if recipe == "fp8-delayed" else recipe]


def train_step(model: nn.Module, x: torch.Tensor, update: Callable[[], None] | None = None):
    """One train step of ``model`` (SGD); ``update`` after it (delayed scaling's)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> None:
        model(x).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if update is not None:
            update()

    return step


def amped_step(base: nn.Module, scaling: str, x: torch.Tensor, emulate: bool | None):
    """amped's ``fp8-<scaling>`` train step on a copy of ``base``."""
    ours = amped_model(base, f"fp8-{scaling}", emulate)
    layers = [m for m in ours.modules() if hasattr(m, "float8_config")]
    update = (lambda: update_delayed_scaling(layers)) if scaling == "delayed" else None
    return train_step(ours, x, update)


def run_cpu(args: argparse.Namespace, figures: dict | None = None) -> None:
    base = stack(args.dim, args.layers)
    x = torch.randn(args.tokens, args.dim, dtype=torch.bfloat16)
    d, h = args.dim, 4 * args.dim
    print(
        f"CPU: {args.layers} x [Linear({d},{h}) GELU Linear({h},{d})], {args.tokens} bf16 tokens, "
        f"SGD, {torch.get_num_threads()} threads, median of {args.repeats} repeats of "
        f"{args.steps} steps, oneDNN off"
    )
    header = ("recipe", "amped scaled_mm / torchao", "amped emulated / torchao", "torchao ms/step")
    print(f"{header[0]:<18}{header[1]:>27}{header[2]:>26}{header[3]:>17}")
    with torch.backends.mkldnn.flags(enabled=False):
        for scaling in FP8_SCALINGS:
            recipe = f"fp8-{scaling}"
            variants = {
                "scaled_mm": amped_step(base, scaling, x, emulate=False),
                "emulated": amped_step(base, scaling, x, emulate=True),
                "torchao": train_step(torchao_model(base, torchao_of(recipe)), x),
            }
            times = interleaved(variants, args.repeats, args.steps, lambda: None)
            name = recipe + (" *" if scaling == "delayed" else "")
            ms = statistics.median(times["torchao"]) / args.steps * 1e3
            real, emulated = (
                ratio(times, "scaled_mm", "torchao"),
                ratio(times, "emulated", "torchao"),
            )
            print(f"{name:<18}{real:>27.3f}{emulated:>26.3f}{ms:>17.1f}")
            if figures is not None:
                figures[recipe] = {
                    "scaled_mm/torchao": real,
                    "emulated/torchao": emulated,
                    "torchao_ms_per_step": ms,
                }
    print("* against torchao's tensorwise recipe (torchao has no delayed scaling)")


def run_gpu(
    dim: int = 8192,
    layers: int = 4,
    tokens: int = 16384,
    repeats: int = 7,
    steps: int = 5,
    figures: dict | None = None,
) -> bool:
    """FP8 recipes vs bf16-mixed and vs torchao on an FP8 GPU; False (and a line) if none.

    ``figures``, if given, receives each recipe's speed-up and ratio by name."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        print("GPU: skipped (no CUDA device with FP8 GEMMs, compute capability >= 8.9)")
        return False
    no_torchao = torchao_missing()
    if no_torchao is not None:
        print(f"GPU: torchao left out ({no_torchao})")
    device = torch.device("cuda")
    base = stack(dim, layers).to(device)
    x = torch.randn(tokens, dim, device=device)
    print(
        f"GPU {torch.cuda.get_device_name()}: {layers} blocks d={dim}, {tokens} tokens; "
        f"median of {repeats} repeats of {steps} steps"
    )

    def under_bf16(step: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                step()

        return run

    bf16 = under_bf16(train_step(copy.deepcopy(base), x))
    for scaling in FP8_SCALINGS:
        recipe = f"fp8-{scaling}"
        variants = {"amped": under_bf16(amped_step(base, scaling, x, None)), "bf16": bf16}
        if no_torchao is None:
            variants["torchao"] = under_bf16(train_step(torchao_model(base, torchao_of(recipe)), x))
        times = interleaved(variants, repeats, steps, torch.cuda.synchronize)
        speedup = 1 / ratio(times, "amped", "bf16")
        vs_torchao = ratio(times, "amped", "torchao") if no_torchao is None else None
        print(
            f"fp8-{scaling:<16} speed-up over bf16-mixed {speedup:.2f}x   "
            f"amped/torchao {'-' if vs_torchao is None else f'{vs_torchao:.3f}'}"
        )
        if figures is not None:
            figures[recipe] = {"speedup/bf16": speedup, "amped/torchao": vs_torchao}
    return True


def run_step(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu: dict = {}
    if not args.gpu_only:
        run_cpu(args, cpu)
    gpu: dict = {}
    ran = run_gpu(
        args.gpu_dim, args.gpu_layers, args.gpu_tokens, args.gpu_repeats, args.gpu_steps, gpu
    )
    gpu_block = block_formats.run_gpu(
        args.gpu_dim, args.gpu_layers, args.gpu_tokens, args.gpu_repeats, args.gpu_steps
    )
    if args.json:
        figures = {"cpu": cpu, "gpu": gpu if ran else None, "gpu_ran": ran}
        Path(args.json).write_text(to_json({**figures, "gpu_block": gpu_block}))


# --- layers: the emulated GEMMs, forward and backward ---------------------------------


def forward_backward(
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


def layer_variants(args: argparse.Namespace) -> dict[str, Callable[[], None]]:
    base = stack(args.dim, 1)
    torch.manual_seed(1)
    x = torch.randn(args.tokens, args.dim)
    grad = torch.randn(args.tokens, args.dim) * 1e-2
    xb, gb = x.to(torch.bfloat16), grad.to(torch.bfloat16)
    low = copy.deepcopy(base).to(torch.bfloat16)  # torchao's MX layer wants one dtype
    steps = {
        "float32": forward_backward(copy.deepcopy(base), x, grad),
        "bf16": forward_backward(copy.deepcopy(low), xb, gb),
    }
    gemms = {"both": ["bf16", "auto"]}.get(args.gemm, [args.gemm])
    for recipe in args.recipes:
        for gemm in gemms:
            name = f"amped {recipe}" + (f" [{gemm}]" if len(gemms) > 1 else "")
            steps[name] = forward_backward(amped_model(low, recipe), xb, gb, gemm)
    if not args.no_torchao:
        for recipe in ("tensorwise", "rowwise", "mxfp8"):
            steps[f"torchao {recipe}"] = forward_backward(torchao_model(low, recipe), xb, gb)
    return steps


def report_layers(times: dict[str, list[float]], steps: int) -> None:
    ms = {name: statistics.median(t) / steps * 1e3 for name, t in times.items()}

    def vs(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))

    print(f"{'variant':<30} {'ms':>8} {'vs float32':>11} {'vs torchao':>11}")
    for name in times:
        recipe = name.removeprefix("amped ").split(" [")[0]
        ao = f"torchao {TORCHAO_OF[recipe]}" if recipe in TORCHAO_OF else None
        against = f"{vs(name, ao):10.2f}x" if name.startswith("amped") and ao in times else ""
        print(f"{name:<30} {ms[name]:8.1f} {vs(name, 'float32'):10.2f}x {against:>11}")


def rerun_capped_at_avx2(argv: list[str]) -> int:
    """This script's ``argv`` again, in a subprocess whose instruction sets stop at AVX2."""
    argv = [a for a in argv if a != "--isa=avx2"]
    if "--isa" in argv:
        i = argv.index("--isa")
        del argv[i : i + 2]
    command = [sys.executable, "-u", __file__, *argv, "--isa", "avx2"]
    return subprocess.call(command, env=os.environ | AVX2_ENV)


def run_layers(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
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
    times = interleaved(layer_variants(args), args.repeats, args.steps, lambda: None)
    report_layers(times, args.steps)
    print(f"load after {os.getloadavg()}")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    step = commands.add_parser("step", help="the FP8 recipes' train step (CPU; FP8 GPU)")
    step.add_argument("--repeats", type=int, default=9)
    step.add_argument("--steps", type=int, default=3)
    step.add_argument("--dim", type=int, default=256)
    step.add_argument("--layers", type=int, default=2)
    step.add_argument("--tokens", type=int, default=512)
    step.add_argument("--threads", type=int, default=None)
    step.add_argument("--gpu-only", action="store_true")
    step.add_argument("--gpu-dim", type=int, default=8192)
    step.add_argument("--gpu-layers", type=int, default=4)
    step.add_argument("--gpu-tokens", type=int, default=16384)
    step.add_argument("--gpu-repeats", type=int, default=7)
    step.add_argument("--gpu-steps", type=int, default=5)
    step.add_argument("--json", default=None, help="also write the figures to this file")
    layers = commands.add_parser("layers", help="the emulated GEMMs' forward+backward (CPU)")
    layers.add_argument("--threads", type=int, default=1)
    layers.add_argument("--repeats", type=int, default=7)
    layers.add_argument("--steps", type=int, default=2)
    layers.add_argument("--dim", type=int, default=256)
    layers.add_argument("--tokens", type=int, default=1024)
    layers.add_argument("--gemm", choices=["auto", "bf16", "float32", "both"], default="both")
    layers.add_argument("--isa", choices=["native", "avx2"], default="native")
    layers.add_argument("--recipes", type=lambda s: s.split(","), default=list(LAYER_RECIPES))
    layers.add_argument("--no-torchao", action="store_true")
    return parser.parse_args(argv), layers


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args, layers_parser = parse_args(argv)
    if args.command == "step":
        run_step(args)
    elif args.isa == "avx2" and os.environ.get("ONEDNN_MAX_CPU_ISA") != "AVX2":
        sys.exit(rerun_capped_at_avx2(argv))
    else:
        run_layers(args, layers_parser)


if __name__ == "__main__":
    main()
