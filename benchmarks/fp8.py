"""Step time of amped's FP8 recipes against torchao's same recipes, side by side.

**CPU** (always). A stack of ``--layers`` Linear(d, 4d) -> GELU -> Linear(4d, d) blocks
(d = ``--dim``), ``--tokens`` bfloat16 tokens, SGD; each variant has its own copy of
the model (same initial weights). One train step is forward, backward, optimizer step
and zero_grad. Variants run in one process, interleaved one step at a time with the
order rotating every repeat; the printed figure is the median over repeats of
``time(amped) / time(torchao)`` (target <= 1.05).

- ``amped scaled_mm``: amped's layer calling ``torch._scaled_mm`` as torchao does
  (``emulate=False``) - the like-for-like comparison;
- ``amped emulated``: amped's CPU default, its exact float32 emulation.

Both sides run with oneDNN off (``torch.backends.mkldnn.flags(enabled=False)``): on
AMX-INT8 CPUs torch sends e4m3 x e4m3 ``_scaled_mm`` to oneDNN, which on the machine
these figures came from took seconds per GEMM; with it off, torch runs its reference
CPU kernel (dequantize, float32 matmul), for amped and torchao alike. fp8-delayed has
no torchao counterpart (torchao removed delayed scaling): it is timed against torchao's
tensorwise recipe, the closest one.

**GPU** (only on a CUDA device of compute capability >= 8.9; skipped otherwise): a stack
of large Linear layers (``--gpu-dim``, default 8192, ``--gpu-tokens`` 16384), each FP8
recipe against bf16-mixed (target >= 1.3x) and against torchao's same recipe (<= 1.05;
left out, with a line, where torchao does not import). :func:`run_gpu` is importable for
a one-call GPU script; ``--json PATH`` also writes the figures to a file (for
``benchmarks/support/gpu_check.py``). Then, on sm100-class GPUs only, the block recipes with
native block GEMMs against bf16-mixed (``benchmarks/block_formats.py``'s GPU part,
same sizes; ``gpu_block`` in the JSON, None elsewhere).

Usage: python benchmarks/fp8.py [--repeats 9] [--steps 3] [--dim 256] [--layers 2]
                                [--tokens 512] [--threads N] [--gpu-only]
                                [--gpu-dim 8192] [--gpu-layers 4] [--gpu-tokens 16384]
                                [--gpu-repeats 7] [--gpu-steps 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import warnings
from collections.abc import Callable
from pathlib import Path

import block_formats  # benchmarks/, next to this script
import torch
import torch.nn as nn
from block_formats import interleaved, ratio  # one timing loop for both benchmarks

from amped._internal.jsonio import to_json
from amped.lowp.convert import convert_layers
from amped.lowp.float8.config import FLOAT8_CONFIGS
from amped.lowp.float8.delayed import update_delayed_scaling

TORCHAO_NAME = {
    "tensorwise": "tensorwise",
    "rowwise": "rowwise",
    "rowwise-gw-hp": "rowwise_with_gw_hp",
}


def stack(dim: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)]
    return nn.Sequential(*blocks)


def torchao_model(model: nn.Module, scaling: str) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    config = Float8LinearConfig.from_recipe_name(TORCHAO_NAME[scaling])
    return convert_to_float8_training(copy.deepcopy(model), config=config)


def amped_model(model: nn.Module, scaling: str, emulate: bool | None) -> nn.Module:
    ours = copy.deepcopy(model)
    names = [n for n, m in ours.named_modules() if isinstance(m, nn.Linear)]
    convert_layers(ours, FLOAT8_CONFIGS[scaling], names, emulate=emulate)
    return ours


def stepper(model: nn.Module, x: torch.Tensor, update: Callable[[], None] | None = None):
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> None:
        model(x).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if update is not None:
            update()

    return step


def torchao_missing() -> str | None:
    """Why torchao's float8 training cannot be imported here, or None if it can."""
    try:
        torchao_model(nn.Linear(16, 16), "tensorwise")
    except Exception as error:  # an old or mismatched torchao fails in many ways
        return f"{type(error).__name__}: {error}"
    return None


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
        for scaling in ("tensorwise", "rowwise", "rowwise-gw-hp", "delayed"):
            ao_scaling = "tensorwise" if scaling == "delayed" else scaling
            variants = {}
            for label, emulate in (("scaled_mm", False), ("emulated", True)):
                ours = amped_model(base, scaling, emulate)
                layers = [m for m in ours.modules() if hasattr(m, "float8_config")]
                update = (
                    (lambda layers=layers: update_delayed_scaling(layers))
                    if scaling == "delayed"
                    else None
                )
                variants[label] = stepper(ours, x, update)
            variants["torchao"] = stepper(torchao_model(base, ao_scaling), x)
            times = interleaved(variants, args.repeats, args.steps, lambda: None)
            name = f"fp8-{scaling}" + (" *" if scaling == "delayed" else "")
            ms = statistics.median(times["torchao"]) / args.steps * 1e3
            real, emulated = (
                ratio(times, "scaled_mm", "torchao"),
                ratio(times, "emulated", "torchao"),
            )
            print(f"{name:<18}{real:>27.3f}{emulated:>26.3f}{ms:>17.1f}")
            if figures is not None:
                figures[f"fp8-{scaling}"] = {
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

    bf16 = under_bf16(stepper(copy.deepcopy(base), x))
    for scaling in ("tensorwise", "rowwise", "rowwise-gw-hp", "delayed"):
        ours = amped_model(base, scaling, None)
        layers_ = [m for m in ours.modules() if hasattr(m, "float8_config")]
        update = (
            (lambda layers_=layers_: update_delayed_scaling(layers_))
            if scaling == "delayed"
            else None
        )
        variants = {"amped": under_bf16(stepper(ours, x, update)), "bf16": bf16}
        if no_torchao is None:
            variants["torchao"] = under_bf16(
                stepper(torchao_model(base, "tensorwise" if scaling == "delayed" else scaling), x)
            )
        times = interleaved(variants, repeats, steps, torch.cuda.synchronize)
        speedup = 1 / ratio(times, "amped", "bf16")
        vs_torchao = ratio(times, "amped", "torchao") if no_torchao is None else None
        print(
            f"fp8-{scaling:<16} speed-up over bf16-mixed {speedup:.2f}x   "
            f"amped/torchao {'-' if vs_torchao is None else f'{vs_torchao:.3f}'}"
        )
        if figures is not None:
            figures[f"fp8-{scaling}"] = {"speedup/bf16": speedup, "amped/torchao": vs_torchao}
    return True


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--gpu-only", action="store_true")
    parser.add_argument("--gpu-dim", type=int, default=8192)
    parser.add_argument("--gpu-layers", type=int, default=4)
    parser.add_argument("--gpu-tokens", type=int, default=16384)
    parser.add_argument("--gpu-repeats", type=int, default=7)
    parser.add_argument("--gpu-steps", type=int, default=5)
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
