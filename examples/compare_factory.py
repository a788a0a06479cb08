"""A task factory for ``amped compare --model``: an MLP classifying points of three spirals.

Run the comparison on it with::

    amped compare --model examples/compare_factory.py:build --steps 100
    python examples/compare_factory.py --steps 100        # the same

The contract (see ``amped.tasks``): the factory takes any of ``batch_size``, ``seed``
and ``device`` as keyword arguments and returns ``(model, batches, loss_fn)``:

- ``model``: a float32 ``torch.nn.Module``;
- ``batches``: an iterable of ``(inputs, targets)``; here an endless generator;
- ``loss_fn(outputs, targets)``: a scalar tensor.

``amped compare`` calls the factory once per recipe after ``torch.manual_seed(seed)``, so
every recipe starts from the same weights and sees the same batches. To add held-out
metrics, a custom optimizer or a name for the report, return an ``amped.tasks.Task``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

CLASSES = 3
POINTS = 3000


def spirals(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``POINTS`` 2-d points on ``CLASSES`` interleaved noisy spirals, and their labels."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(POINTS) % CLASSES
    radius = torch.rand(POINTS, generator=generator)
    angle = 4 * radius + labels * (2 * math.pi / CLASSES)
    angle = angle + 0.2 * torch.randn(POINTS, generator=generator)
    points = torch.stack([radius * torch.sin(angle), radius * torch.cos(angle)], dim=1)
    return points, labels


def batches(
    points: torch.Tensor, labels: torch.Tensor, batch_size: int, seed: int, device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Random batches, forever, in an order fixed by ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        index = torch.randint(0, len(points), (batch_size,), generator=generator)
        yield points[index].to(device), labels[index].to(device)


def build(batch_size: int = 64, seed: int = 0, device: torch.device | str = "cpu"):
    """The task: (model, batches, loss_fn)."""
    points, labels = spirals(seed)
    model = nn.Sequential(
        nn.Linear(2, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, CLASSES)
    )
    return model, batches(points, labels, batch_size, seed, torch.device(device)), F.cross_entropy


if __name__ == "__main__":
    from amped.cli.main import main

    sys.exit(main(["compare", "--model", f"{__file__}:build", *sys.argv[1:]]))
