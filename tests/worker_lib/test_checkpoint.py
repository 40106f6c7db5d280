"""kelastic.checkpoint with real torch: round trips, the three slots, crashes, corruption,
and a folder too small for the slots."""

from __future__ import annotations

import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

from kelastic import checkpoint, contract
from kelastic.checkpoint import (
    CheckpointError,
    CheckpointStore,
    TreeError,
    slot_bytes,
)
from kelastic.checkpoint.slot_format import HEADER_SIZE, SlotFormatError, decode_header
from kelastic.checkpoint.store import slot_path

REPO = Path(__file__).resolve().parents[2]

SAVER = REPO / "tests" / "workers" / "checkpoint_saver.py"


def _env() -> dict[str, str]:
    paths = [str(REPO), str(REPO / "worker_lib")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1"}


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.99))
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
    return model, optimizer


def _assert_same(a: Any, b: Any, path: str = "state") -> None:
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for key in a:
            _assert_same(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and a != a:
        assert b != b, path
    else:
        assert a == b, path


def test_round_trip_of_a_model_and_its_optimizer(tmp_path: Path) -> None:
    model, optimizer = _model_and_optimizer()
    wide = torch.arange(24, dtype=torch.int64).reshape(4, 6)
    state = {
        "model": model.state_dict(),
        "optim": optimizer.state_dict(),
        "bf16": torch.randn(5, 3).to(torch.bfloat16),
        "int64": wide,
        "transposed": wide.t(),  # non-contiguous
        "strided": torch.randn(10, 10)[::3, 1::2],
        "empty": torch.empty(0, 7),
        "scalar": torch.tensor(2.5),
        "bool": torch.tensor([True, False, True]),
        "plain": {
            "epoch": 3,
            "lr": 1e-3,
            "nan": float("nan"),
            "inf": -float("inf"),
            "name": "digits",
            "none": None,
            "pair": (1, "a"),
            7: [1.5, True],
        },
    }
    with CheckpointStore(tmp_path, rank=0, job="j", capacity=slot_bytes(state)) as ckpt:
        ckpt.save(7, state).wait()
        loaded = ckpt.load()
    assert loaded is not None
    step, got = loaded
    assert step == 7
    _assert_same(state, got)
    assert got["model"]._metadata == state["model"]._metadata  # torch's module versions
    assert isinstance(got["model"], OrderedDict)
    assert got["optim"]["param_groups"][0]["betas"] == (0.8, 0.99)
    fresh, fresh_optimizer = _model_and_optimizer()
    fresh.load_state_dict(got["model"])
    fresh_optimizer.load_state_dict(got["optim"])


def test_the_caller_may_change_its_tensors_once_save_returns(tmp_path: Path) -> None:
    weight = torch.ones(1000)
    with CheckpointStore(tmp_path) as ckpt:
        handle = ckpt.save(1, {"w": weight})
        weight.zero_()  # training goes on while the commit runs
        handle.wait()
        loaded = ckpt.load()
    assert loaded is not None and torch.equal(loaded[1]["w"], torch.ones(1000))


def test_the_three_slots_take_turns_and_the_newest_loads(tmp_path: Path) -> None:
    with CheckpointStore(tmp_path, rank=3, job="j", world_size=4) as ckpt:
        slots = [ckpt.save(step, {"step": torch.tensor(step)}, blocking=True).slot
                 for step in (1, 2, 3, 4, 5)]  # fmt: skip
        assert slots == [0, 1, 2, 0, 1]  # the oldest each time
        assert [(i.slot, i.step, i.seq) for i in ckpt.slots()] == [(1, 5, 5), (0, 4, 4),
                                                                   (2, 3, 3)]  # fmt: skip
        assert ckpt.load() is not None and ckpt.load()[0] == 5  # type: ignore[index]
        assert ckpt.load(step=3) is not None and ckpt.load(step=3)[0] == 3  # type: ignore[index]
        assert ckpt.load(step=2) is None  # overwritten
    # a restarted process (same rank) finds them, and writes the oldest slot next
    with CheckpointStore(tmp_path, rank=3, job="j", world_size=4) as ckpt:
        assert ckpt.load() is not None and ckpt.load()[0] == 5  # type: ignore[index]
        assert ckpt.save(6, {"x": 1}, blocking=True).slot == 2
    reader = CheckpointStore(tmp_path, rank=3, job="j", writable=False)
    assert reader.load() == (6, {"x": 1})
    assert CheckpointStore(tmp_path, rank=3, job="other", writable=False).load() is None
    assert CheckpointStore(tmp_path, rank=0, job="j", writable=False).load() is None


def test_a_failed_commit_is_raised_once_and_the_last_step_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kelastic.checkpoint import commit as commit_module

    with CheckpointStore(tmp_path) as ckpt:
        ckpt.save(1, {"w": torch.ones(4)}).wait()
        real = commit_module.chunk_checksums

        def broken(payload: Any, size: int) -> list[int]:
            raise OSError("checksum thread died")

        monkeypatch.setattr(commit_module, "chunk_checksums", broken)
        ckpt.save(2, {"w": torch.full((4,), 2.0)})
        with pytest.raises(CheckpointError, match="commit of step 2 failed"):
            ckpt.save(3, {"w": torch.full((4,), 3.0)})  # raised by the next call, once
        monkeypatch.setattr(commit_module, "chunk_checksums", real)
        loaded = ckpt.load()
        assert loaded is not None and loaded[0] == 1
        ckpt.save(4, {"w": torch.full((4,), 4.0)}).wait()
        loaded = ckpt.load()
        assert loaded is not None and loaded[0] == 4


def test_an_abort_raised_while_a_save_waits_leaves_the_commit_pending(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An in-process abort (RestartAbort) is raised into the trainer's thread wherever it
    # is, also while a save waits for the previous commit. The commit still runs: the
    # next save must wait for it, not stage into the slot it is committing (the store
    # once forgot it, and two writers shared a slot).
    from kelastic.checkpoint import commit as commit_module

    release = threading.Event()
    real = commit_module.chunk_checksums
    slowed: list[int] = []

    def slow(payload: Any, size: int) -> list[int]:
        if not slowed:  # step 2's commit only
            slowed.append(1)
            release.wait(30)
        return real(payload, size)

    class Abort(BaseException):
        pass

    with CheckpointStore(tmp_path) as ckpt:
        ckpt.save(1, {"w": torch.ones(4)}).wait()
        monkeypatch.setattr(commit_module, "chunk_checksums", slow)
        pending = ckpt.save(2, {"w": torch.full((4,), 2.0)})

        def abort(signum: int, frame: Any) -> None:
            raise Abort

        old = signal.signal(signal.SIGALRM, abort)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            with pytest.raises(Abort):
                ckpt.save(3, {"w": torch.full((4,), 3.0)})  # waits for step 2: aborted
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        assert not pending.done()
        release.set()
        handle = ckpt.save(3, {"w": torch.full((4,), 3.0)})  # waits for step 2 first
        assert pending.done() and handle.slot != pending.slot
        handle.wait()
        assert sorted(i.step for i in ckpt.slots()) == [1, 2, 3]
        loaded = ckpt.load(step=2)
        assert loaded is not None and bool((loaded[1]["w"] == 2.0).all())


def test_a_slot_that_outgrows_its_capacity_grows(tmp_path: Path) -> None:
    with CheckpointStore(tmp_path, capacity=slot_bytes({"w": torch.zeros(10)})) as ckpt:
        ckpt.save(1, {"w": torch.zeros(10)}, blocking=True)
        ckpt.save(2, {"w": torch.zeros(10), "m": torch.ones(100_000)}, blocking=True)
        loaded = ckpt.load()
    assert loaded is not None and loaded[0] == 2 and loaded[1]["m"].sum() == 100_000


_OTHER_WRITER = """
import sys
from kelastic.checkpoint import CheckpointError, CheckpointStore
try:
    CheckpointStore(sys.argv[1], rank=1)
except CheckpointError as exc:
    print(exc)
"""


def test_one_writer_per_rank_and_a_forked_child_holds_no_lock(tmp_path: Path) -> None:
    other = [sys.executable, "-c", _OTHER_WRITER, str(tmp_path)]
    with CheckpointStore(tmp_path, rank=1):
        out = subprocess.run(other, capture_output=True, text=True, env=_env(), check=True)
        assert f"(pid {os.getpid()})" in out.stdout and "one writer per rank" in out.stdout
        CheckpointStore(tmp_path, rank=2).close()  # another rank is another writer
        child = os.fork()
        if child == 0:  # a DataLoader-like child that outlives its parent's store
            try:
                signal.pause()
            finally:
                os._exit(0)
    try:  # the store is closed; its forked child still lives and holds nothing
        with CheckpointStore(tmp_path, rank=1) as again:
            again.save(1, {}, blocking=True)
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_a_store_dropped_unclosed_gives_back_its_descriptors_and_its_lock(tmp_path: Path) -> None:
    """A forgotten ``close()`` costs nothing once the store is collected: its three slot
    files' descriptors and the rank's lock (found in CI: ~600 unclosed read-only stores
    kept ~1800 fds open, and a later ``select()`` refused descriptors past 1024)."""
    import gc

    def open_fds() -> list[str]:
        """The descriptors this process holds into the store's folder (the process's
        other fds are not counted: a test run's other threads open and close theirs;
        CI once saw 27 == 28 from a count of all of them)."""
        held = []
        for name in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{name}")
            except OSError:
                continue  # closed since the listing (the listing's own fd, another thread's)
            if target.startswith(str(tmp_path)):
                held.append(target)
        return sorted(held)

    with CheckpointStore(tmp_path, rank=0) as writer:
        writer.save(1, {"w": torch.ones(4)}, blocking=True)
    gc.collect()
    before = open_fds()
    assert before == []  # the closed writer holds nothing
    for _ in range(20):
        reader = CheckpointStore(tmp_path, rank=0, writable=False)
        assert reader.load() is not None
        assert open_fds() != before  # the count sees a live reader's slots
        del reader
    CheckpointStore(tmp_path, rank=1, writable=False)  # no slots written: none kept
    gc.collect()
    assert open_fds() == before
    dropped = CheckpointStore(tmp_path, rank=0)  # the rank's writer, never closed
    del dropped
    gc.collect()
    assert open_fds() == before
    with CheckpointStore(tmp_path, rank=0) as again:  # its lock went with it
        again.save(2, {"w": torch.ones(4)}, blocking=True)
        again.close()  # closing twice closes nothing twice
    gc.collect()
    assert open_fds() == before


def test_a_slot_closed_under_a_live_view_closes_its_descriptor_once(tmp_path: Path) -> None:
    """The persister closes a slot whose map a traceback's frame still views: the close
    raises BufferError, the descriptor is closed all the same, and the collector never
    closes its number again (CI: 83 "Bad file descriptor" from the finalizer; a number
    reused by then would have closed another file)."""
    import gc

    from kelastic.checkpoint._slotfile import SlotFile

    seen: list[BaseException | None] = []
    hook, sys.unraisablehook = sys.unraisablehook, lambda u: seen.append(u.exc_value)
    try:
        f = SlotFile(tmp_path / "slot", writable=True)
        f.grow(4096)
        assert f.map is not None
        view = memoryview(f.map)
        fd = f.fd
        with pytest.raises(BufferError):
            f.close()
        assert f.fd == -1
        with pytest.raises(OSError):
            os.fstat(fd)  # closed
        reused = os.open(tmp_path / "other", os.O_CREAT | os.O_RDWR)  # likely the same number
        del view
        f.map = None
        del f
        gc.collect()
        os.fstat(reused)  # still open: nothing closed it behind our back
        os.close(reused)
    finally:
        sys.unraisablehook = hook
    assert seen == [], seen


def test_unsupported_values_are_refused_with_their_path(tmp_path: Path) -> None:
    with CheckpointStore(tmp_path) as ckpt:
        for state, where in (
            ({"a": {"b": {1, 2}}}, "state['a']['b']"),
            ({"a": [torch.device("cpu")]}, "state['a'][0]"),
            ({"s": torch.ones(2, 2).to_sparse()}, "['s']"),
            ({"big": 2**64}, "2**63"),
            ({(1, frozenset()): 3}, "key"),
        ):
            with pytest.raises(TreeError, match=__import__("re").escape(where)):
                ckpt.save(1, state)
        with pytest.raises(SlotFormatError, match="step"):
            ckpt.save(-1, {})
        assert ckpt.load() is None  # nothing was touched


def test_module_level_save_and_load_use_the_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(contract.ENV_CHECKPOINT_DIR, str(tmp_path))
    monkeypatch.setenv(contract.RANK, "5")
    monkeypatch.setenv(contract.WORLD_SIZE, "8")
    monkeypatch.setenv(contract.TORCHELASTIC_RUN_ID, "job-uid")
    monkeypatch.setattr(checkpoint, "_default", None)
    monkeypatch.setattr(checkpoint, "_sized", False)
    try:
        assert checkpoint.load() is None  # a fresh start: opens the store, sizes nothing
        assert slot_path(tmp_path, 5, 0).stat().st_size == 0
        checkpoint.save(11, {"w": torch.ones(3)}).wait()
        loaded = checkpoint.load()
        assert loaded is not None and loaded[0] == 11
        assert slot_path(tmp_path, 5, 1).stat().st_size >= slot_bytes({"w": torch.ones(3)})
        info = checkpoint.default_store().slots()[0]
        assert (info.rank, info.world_size, info.job) == (5, 8, "job-uid")
        assert slot_path(tmp_path, 5, 0).stat().st_size >= slot_bytes({"w": torch.ones(3)})
    finally:
        checkpoint.default_store().close()


_RANK_SAVER = """
import os
import torch
from kelastic import checkpoint
rank = int(os.environ["RANK"])
for step in range(1, 4):  # each rank its own part (sharded), or its replica (DDP)
    shard = torch.full((1000 * (rank + 1),), float(100 * rank + step))
    checkpoint.save(step, {"shard": shard, "rank": rank})
checkpoint.default_store().close()
"""


def test_ranks_share_the_folder_each_with_its_own_slots(tmp_path: Path) -> None:
    procs = [
        subprocess.Popen([sys.executable, "-c", _RANK_SAVER],
                         env={**_env(), contract.ENV_CHECKPOINT_DIR: str(tmp_path),
                              contract.RANK: str(rank), contract.WORLD_SIZE: "2",
                              contract.TORCHELASTIC_RUN_ID: "job"})
        for rank in (0, 1)
    ]  # fmt: skip
    assert [p.wait(120) for p in procs] == [0, 0]
    for rank in (0, 1):
        loaded = CheckpointStore(tmp_path, rank=rank, job="job", writable=False).load()
        assert loaded is not None
        step, state = loaded
        assert (step, state["rank"], state["shard"].numel()) == (3, rank, 1000 * (rank + 1))
        assert bool((state["shard"] == 100 * rank + 3).all())
    assert sorted(p.name for p in tmp_path.glob("*.slot*")) == [
        f"rank-{r}.slot{s}" for r in (0, 1) for s in (0, 1, 2)]  # fmt: skip


_DDP = """
import os, sys
import torch, torch.distributed as dist
from kelastic import checkpoint
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 4))
optim = torch.optim.Adam(model.parameters(), lr=0.01)
start = 0
restored = checkpoint.load()
if restored is not None:
    start, state = restored
    model.module.load_state_dict(state["model"])
    optim.load_state_dict(state["optim"])
    start += 1
for step in range(start, start + int(sys.argv[1])):
    torch.manual_seed(1000 * step + rank)  # each rank its own batch; DDP averages
    model(torch.randn(8, 16)).sum().backward()
    optim.step()
    optim.zero_grad()
    checkpoint.save(step, {"model": model.module.state_dict(), "optim": optim.state_dict()})
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
print(f"rank {rank} start {start} sum {flat.double().sum().item():.12f}", flush=True)
checkpoint.default_store().close()
dist.destroy_process_group()
"""


def _ddp(tmp_path: Path, steps: int) -> list[str]:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [
        subprocess.Popen([sys.executable, "-c", _DDP, str(steps)], stdout=subprocess.PIPE,
                         text=True, env={**_env(), contract.ENV_CHECKPOINT_DIR: str(tmp_path),
                                         contract.RANK: str(rank), contract.WORLD_SIZE: "2",
                                         contract.MASTER_ADDR: "127.0.0.1",
                                         contract.MASTER_PORT: str(port),
                                         contract.TORCHELASTIC_RUN_ID: "ddp"})
        for rank in (0, 1)
    ]  # fmt: skip
    outs = [p.communicate(timeout=180)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    return outs


def test_a_gloo_ddp_job_resumes_from_its_ranks_slots(tmp_path: Path) -> None:
    """2 ranks of DDP save every step; a restart of both resumes from the step after
    the last one, every rank from its own replica, and trains on identically."""
    first = _ddp(tmp_path, 3)
    assert [line.split()[3] for line in first] == ["0", "0"]
    sums = {line.split()[5] for line in first}
    assert len(sums) == 1  # DDP: the replicas agree
    for rank in (0, 1):  # what each rank committed is what it trained to
        loaded = CheckpointStore(tmp_path, rank=rank, job="ddp", writable=False).load()
        assert loaded is not None and loaded[0] == 2
        weight, bias = loaded[1]["model"]["weight"], loaded[1]["model"]["bias"]
        total = torch.cat([weight.flatten(), bias.flatten()]).double().sum().item()
        assert f"{total:.12f}" in sums
    second = _ddp(tmp_path, 2)
    assert [line.split()[3] for line in second] == ["3", "3"]  # resumed after step 2
    assert len({line.split()[5] for line in second}) == 1


# ------------------------------------------------------------------ corruption


def _two_steps(directory: Path) -> None:
    with CheckpointStore(directory, job="j") as ckpt:
        ckpt.save(1, {"w": torch.full((3000,), 1.0)}, blocking=True)
        ckpt.save(2, {"w": torch.full((3000,), 2.0)}, blocking=True)


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def _where(path: Path, part: str) -> int:
    raw = path.read_bytes()
    lay = decode_header(raw[:HEADER_SIZE], file_size=len(raw)).layout
    return {
        "header": 100,
        "commit": 17,
        "table": HEADER_SIZE + 1,
        "payload": lay.payload_offset + 5000,
        "manifest": lay.manifest_offset + 10,
    }[part]


@pytest.mark.parametrize("part", ["header", "commit", "table", "payload", "manifest"])
def test_a_corrupted_slot_falls_back_to_the_other(tmp_path: Path, part: str) -> None:
    _two_steps(tmp_path)
    newest = slot_path(tmp_path, 0, 1)
    _flip(newest, _where(newest, part))
    ckpt = CheckpointStore(tmp_path, job="j", writable=False)
    loaded = ckpt.load()
    assert loaded is not None and loaded[0] == 1 and bool((loaded[1]["w"] == 1.0).all())
    assert sorted(ckpt.skipped)[0][0] == 1 and sorted(ckpt.skipped)[1:] == [(2, "empty")]
    assert ckpt.load(step=2) is None


def test_both_slots_corrupted_load_nothing(tmp_path: Path) -> None:
    _two_steps(tmp_path)
    for slot in (0, 1):
        path = slot_path(tmp_path, 0, slot)
        _flip(path, _where(path, "payload"))
    ckpt = CheckpointStore(tmp_path, job="j", writable=False)
    assert ckpt.load() is None
    assert sorted(ckpt.skipped)[2] == (2, "empty")  # the third was never written
    assert all("crc32" in why for _, why in sorted(ckpt.skipped)[:2]), ckpt.skipped


def test_a_payload_of_many_chunks_is_read_by_threads_and_each_chunk_checked(
    tmp_path: Path,
) -> None:
    """A load copies and checks the payload's 4 MiB chunks on several threads: the state
    comes back bit for bit; a flipped byte in the last chunk is named by its chunk and the
    other slot loads; the store closes after it (no export of the slot's map is left)."""
    gen = torch.Generator().manual_seed(5)
    state = {
        "w": torch.randn(9 << 20 >> 2, generator=gen),  # 9 MiB: 3 chunks
        "b": torch.arange(1000, dtype=torch.int64),
        "h": torch.ones(3, dtype=torch.bfloat16),
    }
    with CheckpointStore(tmp_path, job="j") as ckpt:
        ckpt.save(1, {k: v * 0 for k, v in state.items()}, blocking=True)
        ckpt.save(2, state, blocking=True)
        loaded = ckpt.load()
        assert loaded is not None and loaded[0] == 2
        assert all(torch.equal(loaded[1][k], v) for k, v in state.items())
    newest = slot_path(tmp_path, 0, 1)
    raw = newest.read_bytes()
    lay = decode_header(raw[:HEADER_SIZE], file_size=len(raw)).layout
    assert lay.chunk_count >= 3
    _flip(newest, lay.payload_offset + lay.payload_len - 1)
    ckpt = CheckpointStore(tmp_path, job="j", writable=False)
    loaded = ckpt.load()
    assert loaded is not None and loaded[0] == 1
    assert sorted(ckpt.skipped) == [
        (1, f"payload chunk {lay.chunk_count - 1} (bytes {(lay.chunk_count - 1) * lay.chunk_size}"
            f"..{lay.payload_len}) fails its crc32"), (2, "empty")], ckpt.skipped  # fmt: skip
    ckpt.close()  # a BufferError here: the failed read left an export of the map


# ------------------------------------------------------------------ crashes


def _saver(directory: Path, mode: str, elements: int = 1 << 18) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(SAVER), str(directory), mode, str(elements)],
                            stdout=subprocess.PIPE, text=True, env=_env())  # fmt: skip


def _loaded_step(directory: Path) -> int:
    with CheckpointStore(directory, job="crash", writable=False) as store:
        loaded = store.load()  # closed: an unclosed store keeps its slot files' fds
    assert loaded is not None
    step, state = loaded
    assert state["step"] == step
    for tensor in state["w"]:  # whole: every element of every tensor is the step's
        assert bool((tensor == float(step)).all()), step
    return step


@pytest.mark.parametrize("mode,line", [("stage", "staging"), ("commit", "committing")])
def test_sigkill_mid_save_keeps_the_last_committed_step(tmp_path: Path, mode: str,
                                                        line: str) -> None:  # fmt: skip
    proc = _saver(tmp_path, mode)
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "committed 1"
        assert proc.stdout.readline().strip() == line
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert _loaded_step(tmp_path) == 1
    # a new writer of the rank takes the slots over and goes on
    with CheckpointStore(tmp_path, job="crash") as ckpt:
        ckpt.save(9, {"w": [torch.full((4,), 9.0)], "step": 9}).wait()
    assert _loaded_step(tmp_path) == 9


def test_sigkill_at_random_moments_never_tears_a_step(tmp_path: Path) -> None:
    rng = random.Random(21)
    for _ in range(6):
        proc = _saver(tmp_path, "loop", elements=1 << 19)
        assert proc.stdout is not None
        committed = 0
        try:
            for _ in range(rng.randint(2, 8)):
                committed = int(proc.stdout.readline().split()[1])
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            tail = proc.stdout.read().split()
            if tail:
                committed = int(tail[-1])
        finally:
            proc.kill()
            proc.wait()
        step = _loaded_step(tmp_path)
        assert committed <= step <= committed + 1, (committed, step)
        shutil.rmtree(tmp_path)
        tmp_path.mkdir()


# ------------------------------------------------------------------ a folder too small

_OPEN = """
import sys
from kelastic.checkpoint import CheckpointSpaceError, CheckpointStore
try:
    CheckpointStore(sys.argv[1], capacity=int(sys.argv[2]))
except CheckpointSpaceError as exc:
    print("refused", exc.needed, exc)
else:
    print("opened")
"""


def test_a_file_size_limit_fails_at_open_naming_the_bytes(tmp_path: Path) -> None:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    capacity = 3 << 20
    out = subprocess.run([sys.executable, "-c", _OPEN, str(tmp_path), str(capacity)],
                         capture_output=True, text=True, env=_env(), preexec_fn=limit,
                         timeout=60, check=True).stdout  # fmt: skip
    assert out.startswith(f"refused {capacity} "), out
    assert f"{capacity} more bytes" in out and "File too large" in out, out
    assert not any(p.stat().st_size for p in tmp_path.glob("*.slot*"))  # left as they were


_TMPFS = """
import os, sys
from pathlib import Path
import torch
from kelastic.checkpoint import CheckpointSpaceError, CheckpointStore, _slotfile, store
folder = Path(sys.argv[1])
try:  # 3 x 4 MiB in a 8 MiB tmpfs: refused before anything is allocated
    CheckpointStore(folder, capacity=4 << 20)
except CheckpointSpaceError as exc:
    print("too small:", exc.needed, exc.free)
ckpt = CheckpointStore(folder, capacity=2 << 20)  # 3 x 2 MiB: allocated and touched
with open(folder / "filler", "wb", buffering=0) as f:  # another writer takes the rest
    try:
        while True:
            f.write(bytes(1 << 16))
    except OSError as exc:
        print("filled:", exc.strerror)
for step in range(4):  # saves into the allocated slots: no SIGBUS
    ckpt.save(step, {"w": torch.full(((2 << 20) // 4 - 4096,), float(step))}).wait()
print("saved:", ckpt.load()[0])
store.free_bytes = lambda d: -1  # past the free-space check: posix_fallocate refuses
try:
    ckpt.save(9, {"w": torch.zeros(2 << 20)})
except CheckpointSpaceError as exc:
    print("grow refused:", exc.needed, "No space" in str(exc))
print("still:", ckpt.load()[0])
"""


def test_a_small_tmpfs_fails_at_open_and_never_sigbus(tmp_path: Path) -> None:
    """A real 8 MiB tmpfs, mounted in a private mount namespace (``unshare -m``)."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs unshare and root to mount a tmpfs in a private mount namespace")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(_TMPFS))
    shell = (f"mount -t tmpfs -o size=8m kelastic-test {mnt} && "
             f"exec {sys.executable} {script} {mnt}")  # fmt: skip
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", shell],
                          capture_output=True, text=True, env=_env(), timeout=120)  # fmt: skip
    if proc.returncode and "mount" in proc.stderr and "too small" not in proc.stdout:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()[:200]}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines())
    needed, free = map(int, lines["too small"].split())
    assert needed == 3 * (4 << 20) and 0 < free < needed
    assert lines["filled"] == "No space left on device"
    assert lines["saved"] == "3"
    grow_needed, named = lines["grow refused"].split()
    assert int(grow_needed) > 0 and named == "True"
    assert lines["still"] == "3"
