"""Post-training quantization against quantization-aware training, on the built-in task.

The tiny GPT of ``amped compare`` trains ``--steps`` steps under ``bf16-mixed``. Three
held-out losses per seed:

- ``bf16``: the trained model as it is;
- ``PTQ``: the same model with its chosen layers' weights replaced by their grid in
  ``--format`` (:func:`amped.lowp.qat.quantize_weights_`);
- ``QAT``: a run identical up to step ``steps - qat_steps`` that then trains its last
  ``--qat-steps`` steps with those weights fake-quantized
  (:func:`amped.lowp.qat.fake_quantize_weights`), then quantized as PTQ's.

The layers are those the format's recipe converts (the Transformer blocks' feed-forward
Linears; NVFP4's recipe keeps its last one in bfloat16), or with ``--layers all-linear``
every ``nn.Linear`` (the head and attention's output projections too). The gap each leaves against
bf16 is printed per seed, with the means and the seed spread of the bf16 loss.

    python benchmarks/qat.py --format nvfp4 --steps 300 --qat-steps 100 --seeds 0 1 2 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any

import torch

import amped
from amped.lowp.qat import (
    QAT_FORMATS,
    fake_quantize_weights,
    quantize_weights_,
    remove_fake_quantization,
)
from amped.tasks import tiny_gpt


def _train(setup: Any, batches: Any, steps: int, loss_fn: Any) -> None:
    for _ in range(steps):
        x, y = next(batches)
        with setup.autocast():
            loss = loss_fn(setup.model(x), y)
        setup.backward(loss)
        setup.step()
        setup.zero_grad()


def _held_out(task: Any, setup: Any) -> float:
    model = setup.model
    model.eval()
    with torch.no_grad():

        def predict(x: torch.Tensor) -> torch.Tensor:
            with setup.autocast():
                return model(x)

        loss = task.evaluate(predict)["loss"]
    model.train()
    return float(loss)


def _layers(model: torch.nn.Module, which: str) -> list[str] | None:
    """None (the format's recipe's layers) or every nn.Linear the model calls (the head
    included; attention's out_proj too, whose weight MultiheadAttention reads)."""
    if which == "recipe":
        return None
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def _trained(
    seed: int, steps: int, fmt: str, qat_steps: int, which: str = "recipe"
) -> tuple[Any, Any, list[str]]:
    """The task and setup after ``steps`` steps of bf16-mixed, the last ``qat_steps`` with
    the format's layers fake-quantized (none for ``qat_steps=0``), and those layers.
    Runs with the same seed are the same up to the fake quantization (CPU: deterministic)."""
    task = tiny_gpt.build(seed=seed)
    setup = amped.prepare(task.model, task.optimizer(task.model), "bf16-mixed")
    batches = iter(task.batches)
    _train(setup, batches, steps - qat_steps, task.loss_fn)
    layers: list[str] = []
    if qat_steps:
        layers = fake_quantize_weights(setup.model, fmt, _layers(setup.model, which))
        _train(setup, batches, qat_steps, task.loss_fn)
        remove_fake_quantization(setup.model)
    return task, setup, layers


def run_seed(fmt: str, seed: int, steps: int, qat_steps: int, which: str) -> dict[str, Any]:
    """Held-out losses: bf16, PTQ and QAT (see the module)."""
    task, setup, _ = _trained(seed, steps, fmt, 0)
    bf16 = _held_out(task, setup)
    layers = quantize_weights_(setup.model, fmt, _layers(setup.model, which))
    ptq = _held_out(task, setup)
    task, setup, chosen = _trained(seed, steps, fmt, qat_steps, which)
    assert chosen == layers
    quantize_weights_(setup.model, fmt, chosen)
    qat = _held_out(task, setup)
    return {"bf16": bf16, "ptq": ptq, "qat": qat, "layers": layers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--format", choices=QAT_FORMATS, default="nvfp4")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--qat-steps", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--layers",
        choices=("recipe", "all-linear"),
        default="recipe",
        help="the format's recipe's layers, or every nn.Linear (head included)",
    )
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"format={args.format} layers={args.layers} steps={args.steps} "
          f"qat_steps={args.qat_steps} "
          f"seeds={args.seeds} threads={args.threads} load={os.getloadavg()}")  # fmt: skip
    results = {}
    for seed in args.seeds:
        r = run_seed(args.format, seed, args.steps, args.qat_steps, args.layers)
        results[seed] = r
        print(f"seed {seed}: bf16 {r['bf16']:.4f}  PTQ {r['ptq']:.4f} "
              f"(gap {r['ptq'] - r['bf16']:+.4f})  QAT {r['qat']:.4f} "
              f"(gap {r['qat'] - r['bf16']:+.4f})  layers {r['layers']}")  # fmt: skip
    ptq_gaps = [r["ptq"] - r["bf16"] for r in results.values()]
    qat_gaps = [r["qat"] - r["bf16"] for r in results.values()]
    bf16 = [r["bf16"] for r in results.values()]
    closed = [round(p - q, 4) for p, q in zip(ptq_gaps, qat_gaps, strict=True)]
    print(f"mean gap: PTQ {statistics.mean(ptq_gaps):+.4f}, QAT {statistics.mean(qat_gaps):+.4f}; "
          f"bf16 seed spread (max - min) {max(bf16) - min(bf16):.4f}; "
          f"gap closed per seed {closed}; "
          f"load={os.getloadavg()}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
