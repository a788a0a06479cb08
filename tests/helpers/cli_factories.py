"""Task factories for the CLI tests: one that keeps the contract, and ones that break it."""

from __future__ import annotations

import itertools
import time

import torch
import torch.nn.functional as F
from torch import nn

from amped.tasks.task import Task


def _batches(batch_size: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randn(batch_size, 8, generator=generator)
        yield x, (x.sum(dim=1) > 0).long()


def good(batch_size: int = 16, seed: int = 0):
    return (
        nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2)),
        _batches(batch_size, seed),
        F.cross_entropy,
    )


def with_task(seed: int = 0):
    """A Task with held-out metrics, an optimizer and a name."""
    model, batches, loss_fn = good(seed=seed)
    held_out = list(itertools.islice(_batches(32, seed + 1), 2))

    def evaluate(predict):
        correct = sum(int((predict(x).argmax(-1) == y).sum()) for x, y in held_out)
        return {"accuracy": correct / 64}

    return Task(
        model,
        batches,
        loss_fn,
        make_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        evaluate=evaluate,
        name="tiny-classifier",
    )


def finite(seed: int = 0):
    """Five batches only."""
    model, batches, loss_fn = good(seed=seed)
    return model, list(itertools.islice(batches, 5)), loss_fn


def no_batch_size(seed: int = 0):
    return good(seed=seed)


def returns_tensor():
    return torch.zeros(3)


def returns_pair():
    model, batches, _ = good()
    return model, batches


def returns_no_module():
    _, batches, loss_fn = good()
    return "model", batches, loss_fn


def batches_not_pairs():
    model, _, loss_fn = good()
    return model, [torch.zeros(4, 8)], loss_fn


def loss_not_scalar():
    model, batches, _ = good()
    return model, batches, lambda out, y: F.cross_entropy(out, y, reduction="none")


class Exploding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 2)

    def forward(self, x):
        raise RuntimeError("this model cannot run\nsecond line")


def raises_in_forward():
    _, batches, loss_fn = good()
    return Exploding(), batches, loss_fn


class Float32Only(nn.Linear):
    def forward(self, x):
        if torch.is_autocast_enabled("cpu"):
            raise RuntimeError("this model refuses autocast")
        return super().forward(x)


def fails_in_low_precision():
    _, batches, loss_fn = good()
    return Float32Only(8, 2), batches, loss_fn


NOT_CALLABLE = 3


def wide_mlp(batch_size: int = 2, seed: int = 0):
    """8.4M parameters and tiny activations: training state dominates peak memory.

    fp32 with AdamW adds 12 bytes/param in the step (gradients, two moments): ~100 MiB;
    bf16-pure-sr lowers the weights and keeps 2-byte gradients and moments: far less.
    """
    generator = torch.Generator().manual_seed(seed)

    def batches():
        while True:
            x = torch.randn(batch_size, 2048, generator=generator)
            yield x, x

    model = nn.Sequential(nn.Linear(2048, 2048), nn.Linear(2048, 2048))
    return model, batches(), F.mse_loss


def wide_mlp_sgd(batch_size: int = 2, seed: int = 0):
    """:func:`wide_mlp` trained with plain SGD: no optimizer state, no step temporaries.

    Between the fp32 recipe and bf16-master the difference is then the state alone:
    fp32 holds float32 weights and gradients (8 bytes/param); bf16-master bfloat16
    weights and gradients and float32 masters (8), plus its fused step's chunk rows.
    """
    model, batches, loss_fn = wide_mlp(batch_size, seed)
    return Task(
        model, batches, loss_fn, make_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=1e-3)
    )


def exits():
    """A factory that calls sys.exit(0) instead of returning."""
    raise SystemExit(0)


def half_model():
    model, batches, loss_fn = good()
    return model.half(), batches, loss_fn


def details_not_json():
    model, batches, loss_fn = good()
    return Task(model, batches, loss_fn, details={"when": object()})


def negative_threads():
    model, batches, loss_fn = good()
    return Task(model, batches, loss_fn, threads=-3)


def nan_loss(batch_size: int = 16, seed: int = 0):
    """The loss is NaN from step 1 in every recipe."""
    model, batches, _ = good(batch_size, seed)
    return model, batches, lambda out, y: F.cross_entropy(out, y) * float("nan")


def overflows_first(batch_size: int = 16, seed: int = 0):
    """A loss so large that fp16's first steps overflow at the default scale (65536) and
    are skipped, until the scale has backed off below ~2**6."""
    model, batches, _ = good(batch_size, seed)
    return model, batches, lambda out, y: F.cross_entropy(out, y) * 2000.0


class DollarNames(nn.Module):
    """Module names with '$' pairs, which matplotlib's mathtext cannot parse."""

    def __init__(self) -> None:
        super().__init__()
        self.add_module("a$^$b", nn.Linear(8, 16))
        self.add_module("c$\\bad$", nn.Linear(16, 2))

    def forward(self, x):
        return self.get_submodule("c$\\bad$")(self.get_submodule("a$^$b")(x).relu())


def dollar_names(batch_size: int = 16, seed: int = 0):
    _, batches, loss_fn = good(batch_size, seed)
    return DollarNames(), batches, loss_fn


class Sleepy(nn.Linear):
    """A step of ``seconds`` in float32 and half that under autocast (a sleep, so the
    step times are known and cost no CPU on a shared machine)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(8, 2)
        self.seconds = seconds

    def forward(self, x):
        time.sleep(self.seconds / (2 if torch.is_autocast_enabled("cpu") else 1))
        return super().forward(x)


def sleepy(batch_size: int = 16, seed: int = 0):
    """Steps of half a second: 0.5 s in float32, 0.25 s under autocast (long against
    a process's start-up, so a probe cannot fit a third of a 10 s budget)."""
    _, batches, loss_fn = good(batch_size, seed)
    return Sleepy(0.5), batches, loss_fn


def sleepy_fast(batch_size: int = 16, seed: int = 0):
    """:func:`sleepy` at 60 ms a float32 step: enough steps fit a short budget."""
    _, batches, loss_fn = good(batch_size, seed)
    return Sleepy(0.06), batches, loss_fn


class FirstLowStepSlow(Sleepy):
    """:class:`Sleepy` whose first step under autocast in a process sleeps
    ``first_extra`` seconds more: a recipe whose first step compiles something."""

    slept = False  # once per process

    def __init__(self, seconds: float, first_extra: float) -> None:
        super().__init__(seconds)
        self.first_extra = first_extra

    def forward(self, x):
        if torch.is_autocast_enabled("cpu") and not FirstLowStepSlow.slept:
            FirstLowStepSlow.slept = True
            time.sleep(self.first_extra)
        return super().forward(x)


SLOW_FIRST_S = 5.0
"""The extra seconds of :func:`sleepy_fast_slow_first`'s first bf16 step."""


def sleepy_fast_slow_first(batch_size: int = 16, seed: int = 0):
    """:func:`sleepy_fast` whose first bf16 step in a process takes
    :data:`SLOW_FIRST_S` more."""
    _, batches, loss_fn = good(batch_size, seed)
    return FirstLowStepSlow(0.06, SLOW_FIRST_S), batches, loss_fn


TRAINING_FORWARDS = [0]  # forwards with gradients on, by the models below


class _Counted(nn.Sequential):
    def forward(self, x):
        TRAINING_FORWARDS[0] += torch.is_grad_enabled()
        return super().forward(x)


def odd_dims(batch_size: int = 16, seed: int = 0):
    """An MLP whose dims are no multiple of 32: no block recipe converts a layer."""
    torch.manual_seed(seed)
    model = _Counted(nn.Linear(8, 48), nn.GELU(), nn.Linear(48, 40), nn.GELU(), nn.Linear(40, 2))
    return model, _batches(batch_size, seed), F.cross_entropy


def square_mlp(batch_size: int = 16, seed: int = 0):
    """Two 64 x 64 layers and a 64 x 2 head: the block recipes convert ``1`` and ``3``."""
    torch.manual_seed(seed)
    model = _Counted(
        nn.Linear(8, 64), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.Linear(64, 2)
    )
    return model, _batches(batch_size, seed), F.cross_entropy
