"""A training run that checkpoints and resumes, for the kill-and-resume test.

Usage: python scaler_train_worker.py CHECKPOINT OUT [--steps N] [--every K] [--slow]

Trains the tiny model with Adam and an amped.GradScaler (hysteresis on, so strategy
counters must survive the checkpoint too), injecting infs at fixed steps. Resumes from
CHECKPOINT if it exists; writes a checkpoint every K steps (printing "saved STEP") and
the final parameters to OUT. With --slow it sleeps a little per step once it has
saved, so that a parent can kill it mid-run.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from scaler_helpers import batch, poison_grad, poisoned_loss, tiny_model

import amped
from amped.checkpoint import load_checkpoint, save_checkpoint

POISONS = ("grad_inf", "loss_nan", "grad_nan", "loss_inf")


def poison_at(step: int) -> str | None:
    return POISONS[step // 13 % 4] if step % 13 == 5 else None


def train(checkpoint: str, steps: int, every: int, slow: bool) -> torch.nn.Module:
    model = tiny_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = amped.GradScaler("cpu", init_scale=2.0**120, growth_interval=3, hysteresis=2)
    start = 0
    if os.path.exists(checkpoint):
        state = load_checkpoint(checkpoint)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        start = state["step"]
    for step in range(start, steps):
        x, y = batch(step)
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y, reduction="sum")
        scaler.scale(poisoned_loss(loss, poison_at(step))).backward()
        poison_grad(model, poison_at(step))
        scaler.step(optimizer)
        scaler.update()
        if (step + 1) % every == 0:
            save_checkpoint(
                checkpoint,
                model=model.state_dict(),
                optimizer=optimizer.state_dict(),
                scaler=scaler.state_dict(),
                step=step + 1,
            )
            print(f"saved {step + 1}", flush=True)
        if slow and step + 1 >= every:
            time.sleep(0.005)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--slow", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = train(args.checkpoint, args.steps, args.every, args.slow)
    save_checkpoint(args.out, params=[p.detach() for p in model.parameters()])
    print("done", flush=True)


if __name__ == "__main__":
    main()
