"""Restore from a peer (``python -m bench checkpoint``'s rows; issue 21 point 7): a rank's
committed slot is replicated to a peer's sidecar (the replica server on loopback), and a
node that lost its slots fetches it back, as ``kelastic_sidecar.replication`` does after a
node loss, measured in one process, the sides taking turns each repetition:

- **torch.load <- disk (page cache)**: the ref row, the same state read back from a file
  (what a restore from a shared volume costs at best);
- **kelastic replicate (send, no rate limit)**: ``send_slot`` of the slot to the peer's
  server, acknowledged (the replica's header checked there, nothing else);
- **kelastic fetch from a peer (crc32 checked)**: ``fetch_slot`` from the peer's server
  into a fresh folder, every chunk checked before the slot is placed;
- **kelastic fetch + load**: the fetch, then the worker's ``load()`` of the fetched slot
  (its crc32 checked again, the tensors built): the whole restore of a rank.

Target: restore from a peer >= 1 GB/s over loopback (the fetch's bytes over its median
seconds).
"""

from __future__ import annotations

import gc
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import CaseResult, Check, Row, log, median

#: The target: bytes per second a fetch from a peer moves, at least.
TARGET_BYTES_PER_S = 1e9
_TOKEN = "0123456789abcdef0123456789abcdef"


def measure_peer_restore(result: CaseResult, label: str, state: Any, reps: int) -> None:
    """Rows and the check of a restore from a peer of ``state`` (its ``label``), over
    ``reps`` repetitions."""
    import torch

    from kelastic.checkpoint import CheckpointStore, slot_bytes
    from kelastic.checkpoint.scan import committed_slots
    from kelastic.checkpoint.store import slot_path
    from kelastic_sidecar.replica import ReplicaServer, fetch_slot, send_slot

    root = Path(tempfile.mkdtemp(prefix="kelastic-bench-peer-", dir="/dev/shm"))
    disk = Path(tempfile.mkdtemp(prefix="kelastic-bench-peer-"))
    node, peer = root / "node", root / "peer"
    node.mkdir()
    peer.mkdir()
    samples: dict[str, list[float]] = {"send": [], "fetch": [], "restore": [], "tload": []}
    nbytes = 0
    server = ReplicaServer(peer, "bench", _TOKEN, host="127.0.0.1", max_slot_bytes=2**40)
    try:
        with CheckpointStore(node, job="bench", capacity=slot_bytes(state)) as store:
            store.save(1, state, blocking=True)
        (slot,) = committed_slots(node, "bench")
        source = slot_path(node, 0, slot.slot)
        torch.save(state, disk / "state.pt")
        server.start()

        def send() -> None:
            started = time.perf_counter()
            send_slot(server.address, _TOKEN, "bench", source)
            samples["send"].append(time.perf_counter() - started)

        def fetch(load: bool) -> None:
            nonlocal nbytes
            fresh = Path(tempfile.mkdtemp(dir=root))
            try:
                started = time.perf_counter()
                nbytes = fetch_slot(server.address, _TOKEN, "bench", 0, 1, slot_path(fresh, 0, 0))
                if load:
                    with CheckpointStore(fresh, job="bench") as store:
                        assert store.load(step=1) is not None
                samples["restore" if load else "fetch"].append(time.perf_counter() - started)
            finally:
                shutil.rmtree(fresh)

        def torch_load() -> None:
            started = time.perf_counter()
            torch.load(disk / "state.pt", weights_only=True)
            samples["tload"].append(time.perf_counter() - started)

        sides = [send, lambda: fetch(False), lambda: fetch(True), torch_load]
        for side in sides:  # warm up
            side()
        samples = {k: [] for k in samples}
        for rep in range(reps):
            for side in sides[rep % len(sides) :] + sides[: rep % len(sides)]:
                gc.collect()
                side()
            log(f"checkpoint: peer {label} rep {rep + 1}: " + ", ".join(
                f"{k} {v[-1]:.3f}" for k, v in samples.items()))  # fmt: skip
    finally:
        server.close()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    group = f"restore from a peer, {label} state dict"
    result.rows += [
        Row("checkpoint", group, "torch.load <- disk (page cache)", "s", samples["tload"],
            ref=True),
        Row("checkpoint", group, "kelastic replicate (send, no rate limit)", "s",
            samples["send"], note="sendfile to the peer's server over loopback, acknowledged"),
        Row("checkpoint", group, "kelastic fetch from a peer (crc32 checked)", "s",
            samples["fetch"], note=f"{nbytes / 1e6:.0f} MB over loopback"),
        Row("checkpoint", group, "kelastic fetch + load (a rank's restore)", "s",
            samples["restore"], note="the fetched slot loaded, its crc32 checked again"),
    ]  # fmt: skip
    rate = nbytes / median(samples["fetch"])
    result.checks.append(Check(
        "checkpoint", f"{label}: restore from a peer >= 1 GB/s over loopback",
        f"{nbytes / 1e6:.0f} MB in {median(samples['fetch']):.3f} s = {rate / 1e9:.2f} GB/s; "
        f"with the load {nbytes / median(samples['restore']) / 1e9:.2f} GB/s",
        rate >= TARGET_BYTES_PER_S,
    ))  # fmt: skip
