"""The built-in task of ``amped compare``: a tiny GPT learning the standard library's source.

Nothing is downloaded: the text is a fixed list of standard-library modules read as
bytes from the running Python (a 256-symbol vocabulary), 90% for training and 10% held
out per file. Everything else is fixed by ``seed``. Pure torch: no CLI extra needed.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from amped.tasks.task import Task

__all__ = ["CORPUS_FILES", "Corpus", "TinyGPT", "build", "load_corpus"]

# Modules that every CPython from 3.10 on ships as plain files under these paths
# (string, re, pathlib and zipfile are left out: they became packages in some release).
CORPUS_FILES = (
    "argparse.py",
    "ast.py",
    "collections/__init__.py",
    "contextlib.py",
    "dataclasses.py",
    "difflib.py",
    "enum.py",
    "functools.py",
    "inspect.py",
    "json/decoder.py",
    "json/encoder.py",
    "random.py",
    "shutil.py",
    "statistics.py",
    "textwrap.py",
    "tokenize.py",
    "traceback.py",
    "typing.py",
)
MIN_CORPUS_BYTES = 200_000  # below this, windows repeat within a few hundred steps
HELD_OUT_FRACTION = 0.1
SEQ_LEN = 64
D_MODEL = 64
N_HEADS = 4
N_LAYERS = 2
EVAL_WINDOWS = 128
LEARNING_RATE = 3e-3
VOCAB = 256  # bytes


@dataclass(frozen=True)
class Corpus:
    """Training and held-out text as byte tensors, and where they came from."""

    train: torch.Tensor
    held_out: torch.Tensor
    files: tuple[str, ...]
    sha256: str


def load_corpus(root: Path | None = None) -> Corpus:
    """Read :data:`CORPUS_FILES` from the standard library (or ``root``), split per file."""
    root = Path(sysconfig.get_path("stdlib")) if root is None else root
    found = [name for name in CORPUS_FILES if (root / name).is_file()]
    texts = [(root / name).read_bytes() for name in found]
    total = sum(len(t) for t in texts)
    if total < MIN_CORPUS_BYTES:
        raise RuntimeError(
            "The built-in task reads Python standard-library sources, but this Python "
            f"ships too few of them under {root} ({total} bytes in {len(found)} files; "
            f"{MIN_CORPUS_BYTES} needed). Install the full Python standard library, or "
            f"pass your own task with --model module:factory. Received: stdlib={root}"
        )
    cuts = [int(len(t) * (1 - HELD_OUT_FRACTION)) for t in texts]
    train = b"\n\n".join(t[:c] for t, c in zip(texts, cuts, strict=True))
    held_out = b"\n\n".join(t[c:] for t, c in zip(texts, cuts, strict=True))
    digest = hashlib.sha256(b"".join(texts)).hexdigest()
    return Corpus(_as_tensor(train), _as_tensor(held_out), tuple(found), digest)


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class TinyGPT(nn.Module):
    """A character-level GPT: embeddings, causal pre-norm Transformer blocks, a head."""

    def __init__(self, vocab: int = VOCAB, seq_len: int = SEQ_LEN, d_model: int = D_MODEL) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab, d_model)
        self.position = nn.Embedding(seq_len, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, N_HEADS, 4 * d_model, dropout=0.0, activation="gelu",
            batch_first=True, norm_first=True,
        )  # fmt: skip
        self.blocks = nn.TransformerEncoder(layer, N_LAYERS, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        mask = nn.Transformer.generate_square_subsequent_mask(seq_len)
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        positions = torch.arange(length, device=tokens.device)
        h = self.token(tokens) + self.position(positions)
        mask = self.get_buffer("causal_mask")[:length, :length]
        h = self.blocks(h, mask=mask, is_causal=True)
        return self.head(self.norm(h))


def next_byte_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the next byte, computed in float32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _windows(text: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    index = starts[:, None] + torch.arange(SEQ_LEN + 1)
    chunk = text[index]
    return chunk[:, :-1], chunk[:, 1:]


def _batches(
    text: torch.Tensor, batch_size: int, seed: int, device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(text) - SEQ_LEN - 1, (batch_size,), generator=generator)
        x, y = _windows(text, starts)
        yield x.to(device), y.to(device)


def _evaluator(
    held_out: torch.Tensor, batch_size: int, device: torch.device
) -> Callable[[Callable[[Any], Any]], dict[str, float]]:
    starts = torch.linspace(0, len(held_out) - SEQ_LEN - 2, EVAL_WINDOWS).long()

    def evaluate(predict: Callable[[Any], Any]) -> dict[str, float]:
        loss_sum, correct, count = 0.0, 0, 0
        for chunk in starts.split(batch_size):
            x, y = (t.to(device) for t in _windows(held_out, chunk))
            logits = predict(x).float()
            loss_sum += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
            correct += int((logits.argmax(-1) == y).sum().item())
            count += y.numel()
        return {"loss": loss_sum / count, "accuracy": correct / count}

    return evaluate


def build(batch_size: int = 16, seed: int = 0, device: torch.device | str = "cpu") -> Task:
    """The default task: a fresh :class:`TinyGPT` and its data, fixed by ``seed``."""
    device = torch.device(device)
    corpus = load_corpus()
    torch.manual_seed(seed)
    model = TinyGPT().to(device)
    return Task(
        model=model,
        batches=_batches(corpus.train, batch_size, seed, device),
        loss_fn=next_byte_loss,
        make_optimizer=lambda m: torch.optim.AdamW(
            m.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.99)
        ),
        evaluate=_evaluator(corpus.held_out, batch_size, device),
        name="tiny-gpt-stdlib",
        threads=1,  # small matmuls: more threads only wait on each other (docs/compare.md)
        description=(
            f"character-level GPT (d={D_MODEL}, {N_LAYERS} layers, context {SEQ_LEN}) "
            f"on {len(corpus.files)} Python standard-library source files"
        ),
        details={
            "corpus_files": list(corpus.files),
            "corpus_sha256": corpus.sha256,
            "train_bytes": len(corpus.train),
            "held_out_bytes": len(corpus.held_out),
            "seq_len": SEQ_LEN,
            "d_model": D_MODEL,
            "layers": N_LAYERS,
        },
    )
