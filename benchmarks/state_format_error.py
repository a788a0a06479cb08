"""Quantization error of Adam's moments in 8 bits: the dynamic map against FP8 formats.

Trains the tiny GPT-2 of ``benchmarks/memory_convergence.py`` (transformers, random
init, ``amped compare``'s bytes) with float32 ``torch.optim.AdamW`` and, at the given
steps, takes the exact moments of every tensor that ``bf16-pure-8bit`` quantizes. Each
moment is then stored blockwise (256 elements, one float32 scale per block: the same
size, 1.016 bytes an element) in one of these formats and read back:

- ``dynamic``: amped's (and torchao's, bitsandbytes') dynamic map, signed for the first
  moment, unsigned for the second (:mod:`amped.recipes.quantized_state`).
- ``e4m3``, ``e5m2``: torch's ``float8_e4m3fn`` and ``float8_e5m2``, each block scaled
  so that its largest magnitude is the format's largest finite value.
- ``ue5m3`` (second moment only, never negative): an unsigned 8-bit float with the sign
  bit spent on a third mantissa bit (5 exponent bits, bias 15, subnormals; largest
  61440), emulated in float32.

Measures, over all quantized elements: the SQNR in dB of each moment (10 log10 of
signal over error power, as torchao reports), the share of nonzero second-moment
elements read back as 0 (underflow: the update becomes ``m / eps``), and the error of
what the optimizer uses, Adam's direction ``m / (sqrt(v) + eps)`` with bias corrections:
its relative L2 error, and the median of the elementwise relative error.

    python benchmarks/state_format_error.py --steps 50 200 --threads 1
"""

from __future__ import annotations

import argparse
import os
import platform

import torch
from memory_convergence import GPT2Logits

from amped.recipes import quantized_state as q8
from amped.tasks import tiny_gpt as default_task

BETAS, EPS, LR = (0.9, 0.99), 1e-8, 3e-3


def moments_at(steps: list[int], seed: int) -> dict[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The exact (float32) moments of the quantized tensors after each of ``steps``."""
    task = default_task.build(seed=seed)
    torch.manual_seed(seed)
    model = GPT2Logits()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS)
    batches = iter(task.batches)
    taken = {}
    for step in range(1, max(steps) + 1):
        x, y = next(batches)
        task.loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if step in steps:
            taken[step] = [
                (state["exp_avg"].clone(), state["exp_avg_sq"].clone())
                for p, state in opt.state.items()
                if q8.quantizes(p.numel())
            ]
    return taken


def _blockwise_float8(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    blocks = value.reshape(-1, q8.BLOCK)
    scale = blocks.abs().amax(-1, keepdim=True).clamp(min=1e-12) / torch.finfo(dtype).max
    return ((blocks / scale).to(dtype).float() * scale).view(value.shape)


def _ue5m3(x: torch.Tensor) -> torch.Tensor:
    """Non-negative float32 ``x`` rounded to nearest-even on the unsigned e5m3 grid."""
    smallest_normal = 2.0**-14
    bits = x.view(torch.int32)
    lsb = (bits >> 20) & 1  # the last kept mantissa bit (3 of 23 kept)
    normal = ((bits + (1 << 19) - 1 + lsb) & ~((1 << 20) - 1)).view(torch.float32)
    subnormal = torch.round(x / 2.0**-17) * 2.0**-17  # 3 bits below 2**-14
    return torch.where(x < smallest_normal, subnormal, normal).clamp(max=61440.0)


def _blockwise_ue5m3(value: torch.Tensor) -> torch.Tensor:
    blocks = value.reshape(-1, q8.BLOCK)
    scale = blocks.amax(-1, keepdim=True).clamp(min=1e-12) / 61440.0
    return (_ue5m3(blocks / scale) * scale).view(value.shape)


def stored(value: torch.Tensor, fmt: str, signed: bool) -> torch.Tensor:
    """``value`` stored in ``fmt`` and read back, as float32."""
    if fmt == "dynamic":
        return q8.dequantize(*q8.quantize(value, signed), signed)
    if fmt == "e4m3":
        return _blockwise_float8(value, torch.float8_e4m3fn)
    if fmt == "e5m2":
        return _blockwise_float8(value, torch.float8_e5m2)
    if fmt == "ue5m3":
        return _blockwise_ue5m3(value)
    raise ValueError(f"unknown format {fmt!r}")


def sqnr(exact: torch.Tensor, approx: torch.Tensor) -> float:
    error = (exact - approx).double().square().sum()
    return float(10 * torch.log10(exact.double().square().sum() / error))


def measure(pairs: list[tuple[torch.Tensor, torch.Tensor]], step: int, m_fmt: str, v_fmt: str):
    m = torch.cat([a.flatten() for a, _ in pairs])
    v = torch.cat([b.flatten() for _, b in pairs])
    m_hat = torch.cat([stored(a.flatten(), m_fmt, True) for a, _ in pairs])
    v_hat = torch.cat([stored(b.flatten(), v_fmt, False) for _, b in pairs])
    c1, c2 = 1 - BETAS[0] ** step, 1 - BETAS[1] ** step

    def direction(m_: torch.Tensor, v_: torch.Tensor) -> torch.Tensor:
        return (m_ / c1) / ((v_ / c2).sqrt() + EPS)

    exact, approx = direction(m, v), direction(m_hat, v_hat)
    relative = ((approx - exact).abs() / exact.abs().clamp(min=1e-30))[exact != 0]
    return {
        "m_sqnr": sqnr(m, m_hat),
        "v_sqnr": sqnr(v, v_hat),
        "v_flushed": float(((v_hat == 0) & (v > 0)).double().mean()),
        "update_rel_l2": float((approx - exact).norm() / exact.norm()),
        "update_median_rel": float(relative.median()),
    }


COMBINATIONS = [
    ("dynamic", "dynamic"),
    ("e4m3", "e4m3"),
    ("e4m3", "e5m2"),
    ("e4m3", "ue5m3"),
    ("dynamic", "ue5m3"),
    ("e4m3", "dynamic"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[50, 200])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu = platform.processor() or platform.machine()
    print(f"torch {torch.__version__}, {cpu}, threads {args.threads}, load {os.getloadavg()}")
    for step, pairs in moments_at(args.steps, args.seed).items():
        count = sum(a.numel() for a, _ in pairs)
        print(f"\nstep {step}: {len(pairs)} tensors, {count} elements")
        print("m format / v format   m SQNR dB  v SQNR dB  v flushed  update rel L2  median rel")
        for m_fmt, v_fmt in COMBINATIONS:
            r = measure(pairs, step, m_fmt, v_fmt)
            print(
                f"{m_fmt:>8} / {v_fmt:<8}   {r['m_sqnr']:9.2f}  {r['v_sqnr']:9.2f}  "
                f"{r['v_flushed']:9.2%}  {r['update_rel_l2']:13.4f}  {r['update_median_rel']:10.4f}"
            )


if __name__ == "__main__":
    main()
