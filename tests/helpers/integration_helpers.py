"""A tiny model, data and hand-written loop shared by the framework-adapter tests."""

from __future__ import annotations

from collections.abc import Callable

import torch

import amped

STEPS_PER_EPOCH = 3
BATCH = 8


def make_net() -> torch.nn.Module:
    """Linear, LayerNorm (kept float32 under O2), GELU, Linear: small but with every role."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(), torch.nn.Linear(16, 4)
    )


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS_PER_EPOCH * BATCH, 8, generator=g)
    y = torch.randint(0, 4, (STEPS_PER_EPOCH * BATCH,), generator=g)
    return [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, len(x), BATCH)]


def loader() -> torch.utils.data.DataLoader:
    x = torch.cat([b[0] for b in batches()])
    y = torch.cat([b[1] for b in batches()])
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.float(), y)


def make_optimizer(params, fused: bool = False) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, fused=fused or None)


def hand_loop(
    recipe: str,
    epochs: int = 2,
    clip: float | None = None,
    accumulate: int = 1,
    overflow_at: Callable[[int], bool] = lambda step: False,
) -> tuple[list[torch.Tensor], amped.recipes.TrainSetup, amped.MemoryReport]:
    """The loop the adapters must reproduce: losses, the setup, its memory report."""
    net = make_net()
    setup = amped.prepare(net, make_optimizer(net.parameters()), recipe)
    losses, seen = [], 0
    report = None
    for _ in range(epochs):
        for x, y in batches():
            with setup.autocast():
                loss = loss_of(setup.model(x), y)
            if overflow_at(seen):
                loss = loss * float("inf")
            losses.append(loss.detach().clone())
            setup.backward(loss / accumulate)
            seen += 1
            if seen % accumulate:
                continue
            if clip is not None:
                setup.clip_grad_norm_(clip)
            setup.step()
            report = amped.memory_report(setup.model, setup.optimizer)
            setup.zero_grad()
    assert report is not None
    return losses, setup, report


def reset_accelerate_state() -> None:
    """Accelerate keeps its state in process-wide singletons; each run starts clean."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
