"""Digits: an elastic DDP training job for kelastic (CPU, gloo).

An MLP learns scikit-learn's bundled 8x8 digits (1797 images, no download). Each rank
trains on its shard of the training split; rank 0 checkpoints every epoch (atomically)
and every rank resumes from the last checkpoint after a restart, so a killed or hung
worker costs at most one epoch. Each step runs inside ``expires(after=...)``: a worker
that hangs is reaped by the sidecar's timer server.

Run it with ``kelastic run examples/digits/elasticjob.yaml``; under torchrun it works
too (without the timer if ``TORCHELASTIC_TIMER_FILE`` is unset).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from kelastic.errors import record
from kelastic.timer import expires


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=16, help="per worker")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument(
        "--step-timeout", type=float, default=10.0, help="seconds; a slower step is a hang"
    )
    p.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=Path(os.environ.get("CHECKPOINT_DIR", "checkpoints")),
        help="shared by all nodes (default $CHECKPOINT_DIR or ./checkpoints)",
    )
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def load_data(seed: int) -> tuple[torch.Tensor, ...]:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    return x_tr, x_te, y_tr, y_te


def save_checkpoint(path: Path, model: nn.Module, opt: torch.optim.Optimizer, epoch: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch}, tmp)
    os.replace(tmp, path)  # atomic: a crash never leaves a torn checkpoint


@record
def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(args.seed)
    x_tr, x_te, y_tr, y_te = load_data(args.seed)
    model = nn.Sequential(
        nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden), nn.ReLU(),
        nn.Linear(args.hidden, 10),
    )  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    ckpt_path = args.checkpoint_dir / "digits.pt"
    start_epoch = 0
    if ckpt_path.exists():
        state = torch.load(ckpt_path, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start_epoch = state["epoch"] + 1
        if rank == 0:
            print(f"resumed from checkpoint: epoch {state['epoch']} done (restart {restart})")
    ddp = DDP(model)
    loss_fn = nn.CrossEntropyLoss()
    # Shard by rank: rank r takes every world-th sample of the epoch's permutation.
    for epoch in range(start_epoch, args.epochs):
        t0 = time.monotonic()
        gen = torch.Generator().manual_seed(args.seed + epoch)
        idx = torch.randperm(len(x_tr), generator=gen)[rank::world]
        # Every rank takes the same number of steps: an extra step on one rank would wait
        # in all-reduce for peers that already left the loop (a hang the timer would reap).
        steps = len(x_tr) // (world * args.batch_size)
        ddp.train()
        total = 0.0
        for step in range(steps):
            batch = idx[step * args.batch_size : (step + 1) * args.batch_size]
            with expires(after=args.step_timeout, scope="train_step"):
                opt.zero_grad()
                loss = loss_fn(ddp(x_tr[batch]), y_tr[batch])
                loss.backward()
                opt.step()
            total += loss.item()
        ddp.eval()
        with torch.no_grad():
            acc = (model(x_te).argmax(1) == y_te).float().mean().item()
        if rank == 0:
            save_checkpoint(ckpt_path, model, opt, epoch)
            print(
                f"epoch {epoch + 1}/{args.epochs} step {(epoch + 1) * steps} "
                f"loss {total / max(steps, 1):.4f} test_acc {acc:.4f} "
                f"world {world} ({time.monotonic() - t0:.2f}s)",
                flush=True,
            )
    dist.barrier()
    if rank == 0:
        print(f"final test accuracy {acc if args.epochs > start_epoch else float('nan'):.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
