"""Low-precision attention, measured three ways (each a subcommand):
- ``sqnr``: each role's SQNR against float32 on a tiny GPT-2's own activations;
- ``timing``: forward + backward time against torch's bf16 SDPA;
- ``convergence``: held-out loss of a tiny GPT-2 per attention config and seed;
- ``memory``: forward + backward peak memory against sequence length (and SDPA math's).

    PYTHONPATH=src python benchmarks/attention.py sqnr --threads 1
    PYTHONPATH=src python benchmarks/attention.py timing --threads 1 --seq 1024
    PYTHONPATH=src python benchmarks/attention.py convergence --steps 300 --seeds 0 1 2 --threads 1
    PYTHONPATH=src python benchmarks/attention.py memory --seqs 1024 2048 4096 8192
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, GPT2Config, GPT2LMHeadModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import amped
from amped.integrations.transformers_attention import attention_forward, convert_attention
from amped.lowp import AttentionConfig
from amped.lowp.attention import scaled_dot_product_attention
from amped.lowp.attention_config import ROLES, AttentionCast
from amped.lowp.float8.cast import sqnr

SQNR_DOC = """Per-role SQNR of amped's low-precision attention on a tiny GPT-2's own activations.

A GPT-2 (transformers, random weights, 4 layers, 4 heads of 32, 256 positions) is
briefly trained on a synthetic learnable task (each sequence repeats a random block of
8 tokens: predicting the next token means attending 7 positions back), so its
attention is not uniform; then one float32 step records each layer's Q, K, V, mask and
output gradient dO (through transformers' attention registry,
``amped.integrations.transformers_attention``). Each role in turn is cast alone, in
each format, and the attention's output and gradients are compared with the same
layer's float32 attention (every role off), as SQNR in dB (``amped.lowp.float8.cast.sqnr``; 20
dB is a 10% relative error in the L2 norm), averaged over layers. Causal-safe scales;
the causal mask of GPT-2.

    PYTHONPATH=src python benchmarks/attention.py sqnr [--threads 1] [--steps 100]
"""
FORMATS = {
    "e4m3/head": AttentionCast("e4m3", "head"),
    "e4m3/block": AttentionCast("e4m3", "block"),
    "e5m2/head": AttentionCast("e5m2", "head"),
    "mxfp8": AttentionCast("mxfp8"),
}
OUTPUTS = ("out", "dq", "dk", "dv")


def _model(steps: int, seq: int) -> tuple[GPT2LMHeadModel, torch.Tensor]:
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=4, n_embd=128, n_head=4, n_positions=seq, vocab_size=64,
                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)  # fmt: skip
    model = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = _periodic(8, seq, g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    print(f"trained {steps} steps; last loss {loss.item():.3f} (uniform: 4.159)")
    return model, _periodic(4, seq, g)


def _periodic(batch: int, seq: int, g: torch.Generator) -> torch.Tensor:
    """Sequences repeating a random block of 8 tokens."""
    return torch.randint(0, 64, (batch, 8), generator=g).repeat(1, seq // 8)


def _record(model: GPT2LMHeadModel, ids: torch.Tensor) -> list[dict]:
    """Each layer's attention inputs and output gradient in one float32 step."""
    layers: list[dict] = []

    def recording(module, query, key, value, attention_mask, *args, **kwargs):
        record = dict(q=query.detach(), k=key.detach(), v=value.detach(), mask=attention_mask)
        layers.append(record)
        out, _ = attention_forward(module, query, key, value, attention_mask, *args,
                                   config=AttentionConfig(), **kwargs)  # fmt: skip
        out.register_hook(lambda grad: record.__setitem__("do", grad.transpose(1, 2)))
        return out, None

    AttentionInterface.register("amped-record", recording)
    AttentionMaskInterface.register("amped-record", sdpa_mask)
    model.set_attn_implementation("amped-record")
    model(input_ids=ids, labels=ids).loss.backward()
    return layers


def _attention(layer: dict, config: AttentionConfig) -> list[torch.Tensor]:
    q, k, v = (layer[n].clone().requires_grad_() for n in "qkv")
    causal = layer["mask"] is None
    out = scaled_dot_product_attention(q, k, v, layer["mask"], is_causal=causal, config=config)
    out.backward(layer["do"])
    return [out.detach(), q.grad, k.grad, v.grad]


def sqnr_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser("attention.py sqnr", description=SQNR_DOC)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, ids = _model(args.steps, args.seq)
    layers = _record(model, ids)
    refs = [_attention(layer, AttentionConfig()) for layer in layers]
    print(f"\n{len(layers)} layers, Q/K/V {tuple(layers[0]['q'].shape)}; SQNR dB "
          "(mean over layers) of out / dQ / dK / dV, one role cast at a time\n")  # fmt: skip
    print("| role | " + " | ".join(FORMATS) + " |")
    print("|------|" + "|".join("---" for _ in FORMATS) + "|")
    presets = {"all six (fp8 preset)": "fp8", "all but dS (fp8-all-but-ds)": "fp8-all-but-ds"}
    rows = [(role, functools.partial(_only, role)) for role in ROLES]
    rows += [(name, functools.partial(_preset, preset)) for name, preset in presets.items()]
    for name, make in rows:
        cells = []
        for rule in FORMATS.values():
            cfg = make(rule)
            got = [_attention(layer, cfg) for layer in layers]
            mean = [sum(sqnr(r[i], g[i]) for r, g in zip(refs, got, strict=True)) / len(got)
                    for i in range(4)]  # fmt: skip
            cells.append(" / ".join("inf" if m == float("inf") else f"{m:.1f}" for m in mean))
        print(f"| {name} | " + " | ".join(cells) + " |")


def _only(role: str, rule: AttentionCast) -> AttentionConfig:
    return AttentionConfig(**{role: rule})


def _preset(preset: str, rule: AttentionCast) -> AttentionConfig:
    """The preset's roles, each in ``rule``'s format (gradients as in the preset)."""
    from amped.lowp.attention_config import ATTENTION_CONFIGS

    base = ATTENTION_CONFIGS[preset]
    return AttentionConfig(**{r: rule for r in base.rules()})


TIMING_DOC = """Forward + backward time of amped's emulated attention against torch's bf16 SDPA.

One process, one torch thread, bfloat16 inputs ``[1, 4, T, 64]``, causal; each side
runs forward and backward once per round, the sides interleaved round by round, and the
figure is the median over rounds of the thread's CPU time (``time.thread_time``: on a
shared machine wall time mostly measures the neighbours). The ratio is each side's
median over torch's. amped's attention is an exact emulation, not a kernel: this says
what the emulation costs on a CPU, and there is no target.

    PYTHONPATH=src python benchmarks/attention.py timing [--seq 1024] [--rounds 5]
"""


def _step(side: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    began = time.thread_time()
    if side == "torch sdpa":
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        out = amped.scaled_dot_product_attention(q, k, v, is_causal=True, config=side)
    out.backward(grad)
    return time.thread_time() - began


def timing_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="attention.py timing", description=TIMING_DOC.split("\n")[0]
    )
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
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


CONVERGENCE_DOC = """Does a small GPT-2 train as well with low-precision attention? Held-out loss
after N steps, per attention config and seed.

A transformers GPT-2 (random init; 2 layers, 2 heads of 32, 64 positions, float32
weights) learns sequences that repeat a random block of 8 tokens (next-token loss;
uniform guessing is ln 64 = 4.16), with AdamW, its attention converted by
``amped.integrations.transformers_attention.convert_attention``:

- ``bf16``: no attention role cast (float32 arithmetic): the control;
- ``fp8``: all six roles FP8 (e4m3 per head, gradients e5m2);
- ``fp8-all-but-ds``: the same with dS (the ``dq`` and ``dk`` roles) not cast;
- ``mxfp8``: all six roles MXFP8.

Each config runs the same seeds (the same init and batches per seed); the held-out
loss is on a fixed batch the runs never train on. A config is "within noise" where its
mean lies within the control's seed spread (min..max).

    PYTHONPATH=src python benchmarks/attention.py convergence --steps 300 --seeds 0 1 2
"""
CONVERGENCE_CONFIGS = ("bf16", "fp8", "fp8-all-but-ds", "mxfp8")
SEQ, VOCAB = 64, 64


def _repeating_batch(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, 8), generator=g).repeat(1, SEQ // 8)


def train_and_evaluate(config: str, seed: int, steps: int) -> float:
    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=SEQ, vocab_size=VOCAB,
                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)  # fmt: skip
    model = GPT2LMHeadModel(cfg)
    assert convert_attention(model, config) == []
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.Generator().manual_seed(1000 + seed)
    for _ in range(steps):
        ids = _repeating_batch(16, data)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    held_out = _repeating_batch(64, torch.Generator().manual_seed(99))
    with torch.no_grad():
        return model(input_ids=held_out, labels=held_out).loss.item()


def convergence_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="attention.py convergence", description=CONVERGENCE_DOC.split("\n")[0]
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--configs", nargs="+", default=list(CONVERGENCE_CONFIGS), choices=CONVERGENCE_CONFIGS
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    configs = ["bf16", *(c for c in args.configs if c != "bf16")]  # the control first
    losses: dict[str, list[float]] = {}
    for config in configs:
        losses[config] = []
        for seed in args.seeds:
            losses[config].append(train_and_evaluate(config, seed, args.steps))
            print(f"{config} seed {seed}: {losses[config][-1]:.4f}", flush=True)
    low, high = min(losses["bf16"]), max(losses["bf16"])
    print(f"{args.steps} steps, seeds {args.seeds}; held-out loss (uniform: 4.159)")
    print("| attention | " + " | ".join(f"seed {s}" for s in args.seeds) + " | mean | vs bf16 |")
    print("|---|" + "---|" * (len(args.seeds) + 2))
    for config, values in losses.items():
        mean = statistics.mean(values)
        verdict = "control" if config == "bf16" else (
            "within bf16's spread" if low <= mean <= high
            else ("above" if mean > high else "below") + " bf16's spread")  # fmt: skip
        cells = " | ".join(f"{v:.4f}" for v in values)
        print(f"| {config} | {cells} | {mean:.4f} | {verdict} |")


MEMORY_DOC = """Peak memory of forward + backward against the sequence length T.

4 heads, head dim 64, batch 1, causal, float32. The peak is the process's resident
high-water mark, reset just before the call (``/proc/self/clear_refs``, Linux), less the
resident memory before it, in a fresh subprocess per measurement (the method of
tests/lowp/test_attention_memory.py). Tiled over query rows and keys, amped's attention
holds O(T) (its inputs, outputs, gradients and per-row statistics) besides a tile's
scores; torch's SDPA math backend holds the T x T scores, their softmax and gradient.

    PYTHONPATH=src python benchmarks/attention.py memory [--seqs 1024 2048 4096 8192]
"""
MEMORY_WORKER = r"""
import json, sys, torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import amped

which, seq = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 4, seq, 64, generator=g).requires_grad_() for _ in range(3))
grad = torch.randn(1, 4, seq, 64, generator=g)

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

before = rss("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # reset the high-water mark
if which == "sdpa-math":
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
else:
    out = amped.scaled_dot_product_attention(q, k, v, is_causal=True, config=which)
out.backward(grad)
print(json.dumps({"peak": rss("VmHWM") - before}))
"""


def _peak_mib(which: str, seq: int) -> float:
    import json
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", MEMORY_WORKER, which, str(seq)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])["peak"] / 2**20


def memory_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="attention.py memory", description=MEMORY_DOC.split("\n")[0]
    )
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--configs", nargs="+", default=["bf16", "fp8"])
    # torch's SDPA math backend holds T x T: measured up to this T
    parser.add_argument("--math-up-to", type=int, default=4096)
    args = parser.parse_args(argv)
    sides = ["sdpa-math", *args.configs]
    print("peak MiB, forward + backward; 4 heads, head dim 64, batch 1, causal, float32")
    print("| T | " + " | ".join(sides) + " |")
    print("|---|" + "---|" * len(sides))
    for seq in args.seqs:
        cells = []
        for side in sides:
            skip = side == "sdpa-math" and seq > args.math_up_to
            cells.append("-" if skip else f"{_peak_mib(side, seq):.0f}")
        print(f"| {seq} | " + " | ".join(cells) + " |", flush=True)


COMMANDS = {
    "sqnr": sqnr_main,
    "timing": timing_main,
    "convergence": convergence_main,
    "memory": memory_main,
}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        sys.exit(__doc__ + f"\nusage: attention.py {{{','.join(COMMANDS)}}} [options]")
    COMMANDS[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    main()
