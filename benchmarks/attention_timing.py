"""Forward + backward time of amped's emulated attention against torch's bf16 SDPA.

One process, one torch thread, bfloat16 inputs ``[1, 4, T, 64]``, causal; each side
runs forward and backward once per round, the sides interleaved round by round, and the
figure is the median over rounds of the thread's CPU time (``time.thread_time``: on a
shared machine wall time mostly measures the neighbours). The ratio is each side's
median over torch's. amped's attention is an exact emulation, not a kernel: this says
what the emulation costs on a CPU, and there is no target.

    PYTHONPATH=src python benchmarks/attention_timing.py [--seq 1024] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import amped


def _step(side: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    began = time.thread_time()
    if side == "torch sdpa":
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        out = amped.scaled_dot_product_attention(q, k, v, is_causal=True, config=side)
    out.backward(grad)
    return time.thread_time() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(1, 4, args.seq, 64, generator=g).bfloat16() for _ in range(4))
    sides = ["torch sdpa", "bf16", "fp8-forward", "fp8", "mxfp8"]
    times: dict[str, list[float]] = {s: [] for s in sides}
    for side in sides:  # warm-up
        _step(side, q, k, v, grad)
    for _ in range(args.rounds):
        for side in sides:
            times[side].append(_step(side, q, k, v, grad))
    base = statistics.median(times["torch sdpa"])
    print(f"T={args.seq}, 4 heads, head dim 64, batch 1, causal, bf16, {args.threads} thread(s)")
    print("| side | forward+backward ms (median) | / torch sdpa |")
    print("|------|------|------|")
    for side in sides:
        med = statistics.median(times[side])
        name = side if side == "torch sdpa" else f'amped config="{side}"'
        print(f"| {name} | {1e3 * med:.1f} | {med / base:.1f}x |")


if __name__ == "__main__":
    main()
