"""Run the numerics doctor on models built to overflow in float16, and on a healthy
tiny GPT-2 in bfloat16; write each report (HTML, JSON, plot) under docs/doctor/.

    python examples/doctor_reports.py [--out docs/doctor]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from amped.doctor import diagnose

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import doctor_models


def _mean(out: torch.Tensor) -> torch.Tensor:
    return out.float().mean()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/doctor")
    out = Path(parser.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    cases = {
        "exp-overflow": doctor_models.exp_overflow,
        "softmax-input-overflow": doctor_models.softmax_input_overflow,
        "norm-variance-overflow": doctor_models.norm_variance_overflow,
    }
    for name, build in cases.items():
        model, x, _, _ = build()
        report = diagnose(model, x, _mean, dtype=torch.float16)
        _save(report, out / name)
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=128)
    ids = torch.randint(0, 128, (2, 16))
    report = diagnose(
        GPT2LMHeadModel(config),
        {"input_ids": ids, "labels": ids},
        lambda o: o.loss,
        dtype=torch.bfloat16,
    )
    _save(report, out / "gpt2-healthy-bf16")


def _save(report, stem: Path) -> None:
    report.save_html(stem.with_suffix(".html"))
    report.save_plot(stem.with_suffix(".png"))
    stem.with_suffix(".json").write_text(report.to_json())
    print(f"{stem.name}:\n{report.summary()}\n")


if __name__ == "__main__":
    main()
