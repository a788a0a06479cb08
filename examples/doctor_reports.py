"""The numerics doctor on three models built to overflow in float16, and on a healthy
tiny GPT-2 in bfloat16: each report (HTML, JSON, plot) is written to a folder.

    python examples/doctor_reports.py                     # a new temporary folder
    python examples/doctor_reports.py --out docs/doctor   # how docs/doctor/ was made

Needs: ``amped[cli]`` (matplotlib draws the plots). The GPT-2 case also needs
``transformers`` (in ``amped[test]``); without it that case is skipped, with a note.
Nothing is downloaded: GPT-2 is built from a config with random weights.

The three models (the doctor's tests use the same ones):

- ``exp-overflow``: ``exp`` of a large linear output: above 11.1, exp overflows float16.
- ``softmax-input-overflow``: pre-softmax scores from a ``Linear`` with huge weights.
- ``norm-variance-overflow``: a hand-written RMSNorm whose mean of squares overflows.
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from amped.cli.doctor.html import save_doctor_plot
from amped.doctor import diagnose
from amped.doctor.report import Report


class ExpHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        with torch.no_grad():
            self.proj.weight.mul_(40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(self.proj(x))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 16)
        self.scores = nn.Linear(16, 16)
        with torch.no_grad():
            self.scores.weight.mul_(100_000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.scores(torch.tanh(self.embed(x))), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * x * torch.rsqrt(variance + 1e-6)


class NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 16)
        with torch.no_grad():
            self.up.weight.mul_(400)
        self.norm = RMSNorm(16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.up(x)))


def exp_overflow() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("embed", nn.Linear(8, 8))
    model.add_module("act", nn.ReLU())
    model.add_module("head", ExpHead())
    return model, torch.randn(4, 8) * 3


def softmax_input_overflow() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Attention(), torch.randn(4, 16)


def norm_variance_overflow() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return NormNet(), torch.randn(4, 16)


def _mean(out: torch.Tensor) -> torch.Tensor:
    return out.float().mean()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=None, help="folder for the reports (default: a new temporary one)"
    )
    given = parser.parse_args().out
    out = Path(given) if given else Path(tempfile.mkdtemp(prefix="amped-doctor-reports-"))
    out.mkdir(parents=True, exist_ok=True)
    cases = {
        "exp-overflow": exp_overflow,
        "softmax-input-overflow": softmax_input_overflow,
        "norm-variance-overflow": norm_variance_overflow,
    }
    for name, build in cases.items():
        model, x = build()
        _save(diagnose(model, x, _mean, dtype=torch.float16), out / name)
    if importlib.util.find_spec("transformers") is None:
        print("gpt2-healthy-bf16: skipped: needs transformers (pip install 'amped[test]')\n")
    else:
        _save(_gpt2_report(), out / "gpt2-healthy-bf16")
    print(f"reports written to {out}")


def _gpt2_report() -> Report:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=128)
    ids = torch.randint(0, 128, (2, 16))
    return diagnose(
        GPT2LMHeadModel(config),
        {"input_ids": ids, "labels": ids},
        lambda o: o.loss,
        dtype=torch.bfloat16,
    )


def _save(report: Report, stem: Path) -> None:
    report.save_html(stem.with_suffix(".html"))
    save_doctor_plot(report, stem.with_suffix(".png"))
    stem.with_suffix(".json").write_text(report.to_json())
    print(f"{stem.name}:\n{report.summary()}\n")


if __name__ == "__main__":
    main()
