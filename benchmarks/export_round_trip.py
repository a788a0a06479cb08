"""Export round trip after a real training run: tiny GPT-2 and Llama, 200 steps per recipe.

For each model (transformers GPT-2 and Llama, random init, 2 layers, 128 wide, vocab
256) and recipe (``nvfp4``, ``mxfp8``, ``fp8-blockwise``; ``--recipes``), train
``--steps`` AdamW steps on byte sequences of Python's standard-library source (the
built-in task's data, :mod:`amped.tasks.tiny_gpt`), then ``amped.export`` with
``check=True`` on two held-out batches of that text: compressed-tensors' decompressor
(or, for ``fp8-blockwise``, the pure-torch DeepSeek dequantizer) must give the training
grid bit for bit and the served forward the training forward's logits bit for bit. Then
``transformers.AutoModelForCausalLM.from_pretrained`` loads the folder on the CPU, and
its decompressed weights are compared with the grid's.

Printed as a Markdown table: final training loss, whether the check passed (``bitwise``;
``warned`` where NVFP4's reciprocal tensor scale did not round-trip and the logits
moved), the export and check time, and the transformers load (``weights equal``, ``no``
with the reason, ``n/a``).

Usage: python benchmarks/export_round_trip.py [--steps 200] [--models gpt2,llama]
                                              [--recipes nvfp4,mxfp8,fp8-blockwise]
                                              [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings
from pathlib import Path

import torch

import amped
from amped.exporting.formats import EXPORT_FORMATS
from amped.exporting.grid import layer_grid, low_precision_layers
from amped.lowp.float8.blockwise import BlockwiseTensor
from amped.tasks import tiny_gpt

SEQ = 64
VOCAB = 256


def _model(name: str) -> torch.nn.Module:
    import transformers

    if name == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=128, n_layer=2, n_head=4,
            bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _batches(data: torch.Tensor, count: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(len(data) - SEQ, (count, 8), generator=generator)
    return [torch.stack([data[s : s + SEQ] for s in row]) for row in starts]


def _transformers_load(folder: Path, setup: amped.TrainSetup, recipe: str) -> str:
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            loaded = AutoModelForCausalLM.from_pretrained(folder, device_map="cpu")
            with torch.no_grad(), setup.autocast():
                loaded(torch.zeros(1, 8, dtype=torch.long))  # decompresses on first use
        except Exception as error:  # a finding to report, not a crash
            return f"no ({type(error).__name__})"
    fmt = EXPORT_FORMATS[recipe]
    layers = low_precision_layers(setup.model)
    for name, layer in layers.items():
        weight = loaded.get_submodule(name).weight
        assert isinstance(weight, torch.Tensor)
        if getattr(layer, "weight_transposed", False):  # a Conv1D keeps [in, out]
            weight = weight.t()
        grid = layer_grid(name, layer, fmt).weight
        if isinstance(grid, BlockwiseTensor):
            expected = grid.dequantize(torch.float32)
        elif recipe != "nvfp4":
            expected = grid.block_values(weight.dtype)
        else:  # compressed-tensors: e * (scale / global_scale), global = 1 / tensor_scale
            assert grid.tensor_scale is not None
            global_scale = (1.0 / grid.tensor_scale.double()).float()
            expected = grid.elements * (grid.scale.float().repeat_interleave(16, 1) / global_scale)
        if weight.shape != expected.shape or not torch.equal(weight, expected.to(weight.dtype)):
            return "no (weights differ: not the grid)"
    return "weights equal"


def run(model_name: str, recipe: str, steps: int, corpus: tiny_gpt.Corpus) -> dict[str, str]:
    torch.manual_seed(0)
    model = _model(model_name)
    setup = amped.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3), recipe)
    for ids in _batches(corpus.train, steps, seed=0):
        with setup.autocast():
            loss = setup.model(input_ids=ids, labels=ids).loss
        setup.backward(loss)
        setup.step()
        setup.zero_grad()
    held_out = _batches(corpus.held_out, 2, seed=1)
    folder = Path(tempfile.mkdtemp()) / "served"
    began = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        amped.export(setup, folder, inputs=held_out)
    seconds = time.perf_counter() - began
    warned = any("round-trip" in str(w.message) for w in caught)
    return {
        "model": model_name,
        "recipe": recipe,
        "loss": f"{loss.item():.3f}",
        "check": "warned" if warned else "bitwise",
        "export+check s": f"{seconds:.1f}",
        "transformers": _transformers_load(folder, setup, recipe),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument("--recipes", default="nvfp4,mxfp8,fp8-blockwise")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    corpus = tiny_gpt.load_corpus()
    print(f"steps={args.steps} threads={args.threads} load={os.getloadavg()[0]:.1f}")
    rows = [
        run(m, r, args.steps, corpus)
        for m in args.models.split(",")
        for r in args.recipes.split(",")
    ]
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(row[k] for k in keys) + " |")


if __name__ == "__main__":
    main()
