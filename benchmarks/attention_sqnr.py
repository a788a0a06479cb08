"""Per-role SQNR of amped's low-precision attention on a tiny GPT-2's own activations.

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

    PYTHONPATH=src python benchmarks/attention_sqnr.py [--threads 1] [--steps 100]
"""

from __future__ import annotations

import argparse
import functools

import torch
from transformers import AttentionInterface, GPT2Config, GPT2LMHeadModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from amped.integrations.transformers_attention import attention_forward
from amped.lowp import AttentionConfig
from amped.lowp.attention import scaled_dot_product_attention
from amped.lowp.attention_config import ROLES, AttentionCast
from amped.lowp.float8.cast import sqnr

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
