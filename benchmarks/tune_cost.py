"""What amped.tune's measurement costs, against one bf16-mixed training step.

On a GPT-2-shaped stack of Linear layers (``--blocks`` blocks of width ``--width``),
times, interleaved and as a median of ``--repeats``: one bfloat16-mixed forward and
backward of the model over the measured batches (the "pass"), and the measurement of
every layer in each format of ``--formats``. Prints the counted passes (from
``PassCount``, the same numbers tuned.json records) and the wall-clock ratio
measurement / pass. On a CPU the FP8 and block GEMMs are emulated, so the wall ratio
is above the pass count; on a GPU with the formats it should approach it.

    python benchmarks/tune_cost.py --threads 1 [--blocks 4] [--width 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import amped
from amped.tuning.measure import eligible_layers, measure


def _model(blocks: int, width: int) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for _ in range(blocks):
        layers += [
            torch.nn.Linear(width, 3 * width),
            torch.nn.Linear(3 * width, width),
            torch.nn.Linear(width, 4 * width),
            torch.nn.GELU(),
            torch.nn.Linear(4 * width, width),
        ]
    return torch.nn.Sequential(*layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--formats", default="fp8-rowwise,mxfp8,nvfp4")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = _model(args.blocks, args.width)
    batches = [
        (torch.randn(args.rows, args.width), torch.randn(args.rows, args.width))
        for _ in range(args.batches)
    ]
    loss_fn = torch.nn.functional.mse_loss
    formats = args.formats.split(",")
    eligible, _ = eligible_layers(model, formats, set())

    def one_pass() -> None:
        for x, y in batches:
            with amped.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(model(x).float(), y)
            loss.backward()
        model.zero_grad(set_to_none=True)

    passes, measures, count = [], [], None
    for _ in range(args.repeats):  # interleaved
        began = time.perf_counter()
        one_pass()
        passes.append(time.perf_counter() - began)
        began = time.perf_counter()
        _, count = measure(model, eligible, batches, loss_fn)
        measures.append(time.perf_counter() - began)
    assert count is not None
    counted = count.to_dict()
    pass_s, measure_s = statistics.median(passes), statistics.median(measures)
    print(
        f"model: {args.blocks} blocks x width {args.width}, {len(eligible)} layers, "
        f"{args.batches} batches of {args.rows} rows; formats {formats}; threads {args.threads}"
    )
    print(
        f"counted passes: capture {counted['capture']}, reference {counted['reference']}, "
        f"per format {counted['formats']}, extra per format {counted['extra_per_format']:.2f} "
        f"(target <= 2)"
    )
    print(
        f"median of {args.repeats}: one pass {pass_s * 1e3:.1f} ms, measurement "
        f"{measure_s * 1e3:.1f} ms, ratio measurement/pass = {measure_s / pass_s:.1f} "
        f"({measure_s / pass_s / len(formats):.1f} per format)"
    )


if __name__ == "__main__":
    main()
