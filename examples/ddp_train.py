"""Train with amped on N processes (DDP), one recipe after another; print each rank's losses.

    torchrun --standalone --nproc_per_node 2 examples/ddp_train.py
    torchrun --standalone --nproc_per_node 2 examples/ddp_train.py \\
        --recipes fp32,bf16-mixed,fp16-mixed,bf16-master --steps 30 --checkpoint /tmp/ckpt.pt
    python examples/ddp_train.py            # without torchrun: one process

Runs on CPUs with gloo, or on GPUs with nccl (one per rank). Every rank builds the same
model and takes its share of the same global batch, so the losses are comparable
across recipes and world sizes. The pattern, per recipe::

    setup = amped.prepare(model, optimizer, recipe)   # first: it may convert the model
    ddp = DistributedDataParallel(setup.model)        # then wrap what it returns
    with setup.autocast():
        loss = loss_fn(ddp(x), y)
    setup.backward(loss); setup.step(); setup.zero_grad()

With ``--checkpoint``, rank 0 saves the last recipe's state atomically at the end, after
checking that every rank's scaler agrees; a rerun resumes from it on every rank.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import amped
from amped.checkpoint import load_checkpoint, save_checkpoint
from amped.scaling.distributed import check_scaler_agreement

GLOBAL_BATCH = 64


def build_model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 10)).to(
        device
    )


def local_batch(step: int, rank: int, world: int, device: torch.device):
    """This rank's rows of the global batch of ``step`` (the same data at any world size)."""
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, 32, generator=generator)
    y = (x[:, :10] + x[:, 10:20].sin()).argmax(dim=1)
    return x.chunk(world)[rank].to(device), y.chunk(world)[rank].to(device)


def train(recipe: str, args: argparse.Namespace, rank: int, world: int, device) -> None:
    model = build_model(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    setup = amped.prepare(model, optimizer, recipe)
    ddp = DistributedDataParallel(setup.model) if world > 1 else setup.model
    start = 0
    if args.checkpoint and os.path.exists(args.checkpoint):
        state = load_checkpoint(args.checkpoint, map_location=device)
        if state["setup"]["recipe"] == setup.recipe.name:
            setup.load_state_dict(state["setup"])
            start = state["step"]
    began = time.perf_counter()
    for step in range(start, start + args.steps):
        x, y = local_batch(step, rank, world, device)
        with setup.autocast():
            loss = F.cross_entropy(ddp(x).float(), y)
        setup.backward(loss)
        stepped = setup.step()
        setup.zero_grad()
        if step % args.print_every == 0 or step == start + args.steps - 1:
            note = "" if stepped else "  (step skipped: inf/NaN gradients)"
            print(f"rank {rank} {recipe:12s} step {step:3d} loss {loss.item():.4f}{note}")
    per_step_ms = (time.perf_counter() - began) / args.steps * 1e3
    scale = setup.scaler.get_scale()
    print(f"rank {rank} {recipe:12s} done: {per_step_ms:.1f} ms/step, loss scale {scale}")
    if args.checkpoint:
        if world > 1:
            check_scaler_agreement(setup.scaler)  # every rank calls it: a collective
        if rank == 0:
            save_checkpoint(args.checkpoint, setup=setup.state_dict(), step=start + args.steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--recipes", default="bf16-mixed", help="comma-separated recipe names")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--print-every", type=int, default=5)
    parser.add_argument("--checkpoint", help="rank 0 saves here; a rerun resumes from it")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1:
        # A bounded time-out: if a rank dies, the others stop with an error instead
        # of waiting forever (gloo notices a closed connection at once).
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))
    try:
        for recipe in args.recipes.split(","):
            train(recipe.strip(), args, rank, world, device)
    finally:
        if world > 1:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
