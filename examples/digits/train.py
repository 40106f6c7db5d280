"""Digits: an elastic DDP training job for kelastic (CPU, gloo).

An MLP learns scikit-learn's bundled 8x8 digits (1797 images, no download). Each rank
trains on its shard of the training split. Two checkpoints: every rank saves every step
in memory (``kelastic.checkpoint``, when the job has ``spec.checkpoint.memory``), and
after a restart every rank loads the step its sidecars agreed on, so a killed or hung
worker costs no step; rank 0 also saves every epoch to the shared ``--checkpoint-dir``
(atomically), which every rank reads when memory holds no step they all have (a new
Pod, a changed world, no kelastic), so a restart costs at most one epoch then. A step
restored in another world size goes on from the samples it had taken (``resume_step``).
Each step runs inside ``expires(after=...)``: a worker that hangs is reaped by the
sidecar's timer server.

The training function is wrapped by ``kelastic.inprocess.Wrapper``: with in-process
restart on (``spec.inProcess.enabled``, ``kelastic run --in-process``) a fault restarts
only that function, on every rank, in the same processes. Data, model and optimizer are
built once per process, outside it, and kept across its calls (*iterations*); each
iteration starts by taking the model, optimizer state and position (epoch, step) of the
rank furthest along (rank 0 unless another stepped further), since ranks stop at
different steps when an iteration is aborted, and prints ``iteration N: params sha256
XXXXXXXX`` on every rank (equal hashes: equal state).
Without in-process restart the Wrapper calls the function once.

Run it with ``kelastic run examples/digits/elasticjob.yaml`` (``--in-process`` for
in-process restart); under torchrun it works too, given a timer FIFO for ``expires()``
(``TORCHELASTIC_ENABLE_FILE_TIMER=1`` makes torchrun serve one).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from kelastic import checkpoint, contract
from kelastic.errors import record
from kelastic.inprocess import CallWrapper, Wrapper
from kelastic.timer import expires


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
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
    return p.parse_args(argv)


def load_data(seed: int) -> tuple[torch.Tensor, ...]:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    return x_tr, x_te, y_tr, y_te


def save_checkpoint(path: Path, model: nn.Module, opt: torch.optim.Optimizer, epoch: int,
                    updates: int) -> None:  # fmt: skip
    """Rank 0's checkpoint of a finished ``epoch`` on the shared disk (``updates``: the
    optimizer steps taken so far)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch,
                "updates": updates}, tmp)  # fmt: skip
    os.replace(tmp, path)  # atomic: a crash never leaves a torn checkpoint


def epoch_on_disk(path: Path, epoch: int, updates: int) -> bool:
    """Whether rank 0's disk checkpoint holds the end of ``epoch`` after ``updates``
    optimizer steps (written just before the epoch's line is printed)."""
    if not path.exists():
        return False
    state = torch.load(path, weights_only=True)
    return bool(state["epoch"] == epoch and state.get("updates") == updates)


def shard(n: int, seed: int, epoch: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s samples of ``epoch`` (indices into the ``n`` training samples, in
    the order it takes them): every ``world``-th of the epoch's permutation from position
    ``rank``, so a step of ``world`` ranks takes ``world`` consecutive batches of it."""
    gen = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(n, generator=gen)[rank::world]


def resume_step(step: int, saved_world: int, world: int, samples: int, batch: int) -> int:
    """The step of an epoch at which ``world`` ranks go on with an epoch that
    ``saved_world`` ranks had taken ``step`` steps of (0 for ``saved_world``: unknown),
    of ``samples`` training samples in batches of ``batch`` per rank.

    An epoch's samples are taken in one permutation's order, ``world`` batches at a step
    (rank ``r`` takes positions ``r, r + world, ...``), so ``step`` steps of
    ``saved_world`` ranks took the permutation's first ``step * saved_world`` batches.
    The new world goes on from its last whole step within them: it sees fewer than
    ``world`` batches again and skips none. An epoch the saved world ended stays ended
    (its last step: the new world's last step). A step index kept as it was would mean
    other samples (4 ranks at step 10 have taken 40 batches; 2 ranks at step 10, 20)."""
    if saved_world < 1 or saved_world == world:
        return step
    if step >= samples // (saved_world * batch):
        return samples // (world * batch)
    return step * saved_world // world


def params_digest(model: nn.Module) -> str:
    """The first 8 hex digits of the sha256 of every parameter's bytes, in order."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:8]


@dataclass
class Training:
    """What one worker process keeps across the wrapped function's iterations.

    Attributes:
        args: the command line.
        data: ``(x_train, x_test, y_train, y_test)``.
        model, opt: the module and its optimizer (never rebuilt in this process).
        epoch: the epoch in progress (0-based); ``step``: steps of it done.
        ckpt_path: rank 0's checkpoint, read when the process starts.
        acc: the last epoch's test accuracy (NaN before one ended).
        updates: optimizer steps taken since the job began, whatever the world size
            (the in-memory checkpoint's step number: it only grows).
        world: the world size ``step`` was taken in (0: not known yet); a new world
            goes on from the same samples (:func:`resume_step`).
        in_memory: whether each step is saved in memory (the job has a checkpoint
            volume: ``kelastic.contract.checkpoint_dir()`` exists).
    """

    args: argparse.Namespace
    data: tuple[torch.Tensor, ...]
    model: nn.Module
    opt: torch.optim.Optimizer
    ckpt_path: Path
    epoch: int = 0
    step: int = 0
    acc: float = float("nan")
    updates: int = 0
    world: int = 0
    in_memory: bool = False

    @classmethod
    def create(cls, args: argparse.Namespace) -> Training:
        """Data, model and optimizer, from the newest checkpoint when there is one: the
        in-memory step the job agreed on, else rank 0's last epoch on disk."""
        torch.manual_seed(args.seed)
        model = nn.Sequential(
            nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden),
            nn.ReLU(), nn.Linear(args.hidden, 10),
        )  # fmt: skip
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        run = cls(args, load_data(args.seed), model, opt, args.checkpoint_dir / "digits.pt")
        run.in_memory = contract.checkpoint_dir().is_dir()
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        rank0 = os.environ.get("RANK", "0") == "0"
        started = time.monotonic()
        # read straight into the model's and the optimizer's tensors (checked first)
        restored = checkpoint.load(into=run.state()) if run.in_memory else None
        if restored is not None:
            run.updates, state = restored
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            run.epoch, run.step = state["epoch"], state["step"]
            run.world = state.get("world", 0)  # a slot saved before it was kept: unknown
            if rank0:
                tier = "on disk" if checkpoint.agreed_tier() == "disk" else "in memory"
                print(f"resumed from checkpoint: epoch {run.epoch} step {run.step} ({tier}, "
                      f"update {run.updates}, loaded in {time.monotonic() - started:.3f} s; "
                      f"restart {restart})")  # fmt: skip
        elif run.ckpt_path.exists():
            state = torch.load(run.ckpt_path, weights_only=True)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            run.epoch, run.updates = state["epoch"] + 1, state.get("updates", 0)
            if rank0:
                print(f"resumed from checkpoint: epoch {state['epoch']} done (restart {restart})")
        return run

    def sync(self) -> int:
        """Take the model, optimizer state and position of the rank furthest along (the
        lowest such rank); every rank calls this. Returns that rank.

        Ranks stop at different steps when an iteration is aborted (one step apart at
        most: a step ends with an all-reduce), and a rank that started again as a new
        process (its peers restarted in process) is back at the last checkpoint: the one
        furthest along has taken every step the others took, with the same gradients.
        """
        positions: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(positions, (self.updates, self.epoch, self.step))
        src = max(range(len(positions)), key=lambda r: (tuple(positions[r]), -r))
        box: list[Any] = [self.state() if dist.get_rank() == src else None]
        dist.broadcast_object_list(box, src=src)
        if dist.get_rank() != src:
            state = box[0]
            self.model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["opt"])
            self.epoch, self.step, self.updates = state["epoch"], state["step"], state["updates"]
            self.world = state["world"]
        return src

    def state(self) -> dict[str, Any]:
        """The model, the optimizer state and the position: what a checkpoint holds."""
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict(),
                "epoch": self.epoch, "step": self.step, "updates": self.updates,
                "world": self.world}  # fmt: skip


def train(run: Training, call_wrapper: CallWrapper | None = None) -> None:
    """One iteration: join the process group, take the furthest rank's state, train to
    the end.

    Raises:
        whatever the training raises; under in-process restart the Wrapper then starts
        the next iteration (an abort arrives as ``RestartAbort``).
    """
    iteration = call_wrapper.iteration if call_wrapper is not None else 0
    if dist.is_initialized():  # the Wrapper destroyed the last iteration's: be sure
        dist.destroy_process_group()
    gc.collect()  # the last iteration's DDP module, if a reference cycle kept it
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    src = run.sync()
    step = resume_step(run.step, run.world, world, len(run.data[0]), run.args.batch_size)
    if step != run.step and rank == 0:
        print(f"world size {run.world} -> {world}: epoch {run.epoch} goes on at step {step} "
              f"(step {run.step} of {run.world} ranks: the same samples)", flush=True)  # fmt: skip
    run.step, run.world = step, world
    digest = params_digest(run.model)
    print(
        f"iteration {iteration}: params sha256 {digest} "
        f"(epoch {run.epoch}, step {run.step}, from rank {src})",
        flush=True,
    )
    ddp = DDP(run.model)
    try:
        _epochs(run, ddp, rank, world, call_wrapper)
    except BaseException as exc:
        # The failed iteration's frames hold its DDP module, whose reducer's autograd hooks
        # (on our parameters) would still fire in the next one: let them go now, even if
        # the exception is kept (the Wrapper reports it).
        traceback.clear_frames(exc.__traceback__)
        raise
    finally:
        del ddp
    dist.barrier()
    if rank == 0:
        # a process started after the last epoch's checkpoint (its Pod replaced as the job
        # ended) trained no epoch: its accuracy is the checkpoint's, measured now
        acc = run.acc if run.acc == run.acc else test_accuracy(run.model, *run.data[1::2])
        print(f"final test accuracy {acc:.4f}")
    dist.destroy_process_group()


def test_accuracy(model: nn.Module, x_test: torch.Tensor, y_test: torch.Tensor) -> float:
    """The fraction of ``x_test`` (N x 64) that ``model`` classifies as ``y_test`` (N)."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        acc = float((model(x_test).argmax(1) == y_test).float().mean().item())
    model.train(was_training)
    return acc


def _epochs(
    run: Training, ddp: nn.Module, rank: int, world: int, call_wrapper: CallWrapper | None
) -> None:
    """Train from ``run``'s position to the last epoch; every rank saves each step in
    memory (with a checkpoint volume), rank 0 each epoch on disk."""
    args, model, opt = run.args, run.model, run.opt
    x_tr, x_te, y_tr, y_te = run.data
    loss_fn = nn.CrossEntropyLoss()
    atomic = call_wrapper.atomic if call_wrapper is not None else contextlib.nullcontext
    # Every rank takes the same number of steps: an extra step on one rank would wait in
    # all-reduce for peers that already left the loop (a hang the timer would reap).
    steps = len(x_tr) // (world * args.batch_size)
    while run.epoch < args.epochs:
        t0 = time.monotonic()
        # resumed at the epoch's last step: its end (rank 0's disk checkpoint, the epoch's
        # line) may have been done before the restart; not done again if the disk says so
        at_end = 0 < steps <= run.step
        # Shard by rank: rank r takes every world-th sample of the epoch's permutation.
        idx = shard(len(x_tr), args.seed, run.epoch, rank, world)
        ddp.train()
        total = 0.0
        for step in range(run.step, steps):
            batch = idx[step * args.batch_size : (step + 1) * args.batch_size]
            with expires(after=args.step_timeout, scope="train_step"):
                opt.zero_grad()
                loss = loss_fn(ddp(x_tr[batch]), y_tr[batch])
                loss.backward()
                with atomic():  # an abort never lands between the update and its count
                    opt.step()
                    run.step, run.updates = step + 1, run.updates + 1
                # the save is part of the step (a stuck save is a hang): staged in memory
                # here, committed on the store's thread while the next step runs
                if run.in_memory:
                    checkpoint.save(run.updates, run.state())
            if call_wrapper is not None:
                call_wrapper.ping()
            total += loss.item()
        run.acc = test_accuracy(model, x_te, y_te)
        if rank == 0 and not (at_end and epoch_on_disk(run.ckpt_path, run.epoch, run.updates)):
            save_checkpoint(run.ckpt_path, model, opt, run.epoch, run.updates)
            print(
                f"epoch {run.epoch + 1}/{args.epochs} step {(run.epoch + 1) * steps} "
                f"loss {total / max(steps, 1):.4f} test_acc {run.acc:.4f} "
                f"world {world} ({time.monotonic() - t0:.2f}s)",
                flush=True,
            )
        run.epoch, run.step = run.epoch + 1, 0


@record
def main(argv: list[str] | None = None) -> None:
    torch.set_num_threads(1)
    run = Training.create(parse_args(argv))  # once per process: kept across iterations

    @Wrapper()
    def wrapped(call_wrapper: CallWrapper | None = None) -> None:
        train(run, call_wrapper)

    wrapped()


if __name__ == "__main__":
    main()
