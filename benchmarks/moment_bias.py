"""Why ``bf16-pure-8bit`` ends below fp32 at low learning rates: the 8-bit moments on their own.

Trains the tiny GPT-2 of ``memory_convergence.py`` (same bytes, batches and settings:
AdamW betas 0.9/0.99, weight decay 0.01, held-out loss) with float32 weights, under
torch's ``AdamW`` (``adamw``) or torchao's ``AdamW8bit`` (``ao8bit``: the same blockwise
8-bit moments as ``bf16-pure-8bit``, with no bfloat16 weights and no stochastic
rounding). For ``ao8bit`` it also keeps, beside the optimizer, the exact float32 moments
of the same gradients (the EMAs that an unquantized AdamW would hold for them) and
prints, at a few steps, over the elements whose moments are quantized:

- ``v_q/v``: mean and median of the dequantized second moment over the exact one, and
  the share of elements where it is smaller (``v low``) or zero (``v 0``);
- ``|m_q|/|m|``: the sum of the dequantized first moment's magnitudes over the exact one's;
- ``step``: the L2 norm of Adam's direction ``m / (sqrt(v) + eps)`` from the quantized
  moments over the norm from the exact ones, and the median elementwise ratio.

    python benchmarks/moment_bias.py --lr 1e-4 --seeds 0 1 2 --threads 1
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
from memory_convergence import GPT2Logits

from amped.tasks import tiny_gpt as default_task

REPORT_AT = (1, 10, 50, 100, 200, 300, 400, 500)


def _moment_stats(
    optimizer: torch.optim.Optimizer, exact: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]
) -> str:
    m_q, v_q, m_e, v_e = [], [], [], []
    for param, (m, v) in exact.items():
        state = optimizer.state[param]
        m_q.append(state["exp_avg"].dequantize().reshape(-1))
        v_q.append(state["exp_avg_sq"].dequantize().reshape(-1))
        m_e.append(m.reshape(-1))
        v_e.append(v.reshape(-1))
    mq, vq, me, ve = (torch.cat(t).double() for t in (m_q, v_q, m_e, v_e))
    live = ve > 0
    ratio = vq[live] / ve[live]
    eps = 1e-8  # bias corrections are the same for both and cancel in the ratio
    step_q = mq / (vq.sqrt() + eps)
    step_e = me / (ve.sqrt() + eps)
    moving = step_e.abs() > 0
    step_ratio = (step_q[moving].abs() / step_e[moving].abs()).median().item()
    return (
        f"v_q/v mean {ratio.mean().item():.4f} median {ratio.median().item():.4f} "
        f"v low {(vq[live] < ve[live]).double().mean().item():.3f} "
        f"v 0 {(vq[live] == 0).double().mean().item():.4f}  "
        f"|m_q|/|m| {(mq.abs().sum() / me.abs().sum()).item():.4f}  "
        f"step L2 {(step_q.norm() / step_e.norm()).item():.4f} median {step_ratio:.4f}"
    )


def run(kind: str, seed: int, steps: int, lr: float) -> float:
    """Held-out loss after ``steps`` steps, printing the moments' statistics for ``ao8bit``."""
    task = default_task.build(seed=seed)
    torch.manual_seed(seed)
    model = GPT2Logits()
    betas = (0.9, 0.99)
    optimizer: torch.optim.Optimizer
    exact: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = {}
    if kind == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=0.01)
    else:
        from torchao.optim import AdamW8bit

        optimizer = AdamW8bit(model.parameters(), lr=lr, betas=betas, weight_decay=0.01)
        for p in model.parameters():
            if p.numel() >= 4096 and p.numel() % 256 == 0:  # torchao's rule
                exact[p] = (torch.zeros_like(p), torch.zeros_like(p))
    batches = iter(task.batches)
    for step in range(1, steps + 1):
        x, y = next(batches)
        loss = task.loss_fn(model(x), y)
        loss.backward()
        for p, (m, v) in exact.items():
            assert p.grad is not None
            m.lerp_(p.grad, 1 - betas[0])
            v.lerp_(p.grad.square(), 1 - betas[1])
        optimizer.step()
        optimizer.zero_grad()
        if exact and step in REPORT_AT:
            print(f"  seed {seed} step {step:4}: {_moment_stats(optimizer, exact)}", flush=True)
    model.eval()

    def predict(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(x)

    assert task.evaluate is not None
    return task.evaluate(predict)["loss"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--kinds", nargs="+", default=["ao8bit", "adamw"])
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu = platform.processor() or platform.machine()
    print(f"torch {torch.__version__}, {cpu}, threads {args.threads}, load {os.getloadavg()}")
    for kind in args.kinds:
        start = time.perf_counter()
        losses = [run(kind, s, args.steps, args.lr) for s in args.seeds]
        print(
            f"lr {args.lr:g} {kind:7} mean {statistics.mean(losses):.4f}  spread "
            f"{max(losses) - min(losses):.4f}  seeds {[round(v, 4) for v in losses]}"
            f"  ({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
