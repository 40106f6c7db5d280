"""Rendezvous cases: join of N nodes, and the new round after one node is SIGKILLed.

torch side: ``DynamicRendezvousHandler`` + ``C10dRendezvousBackend`` on a ``TCPStore``
(what ``torchrun --rdzv-backend=c10d`` uses). kelastic side: ``EtcdRendezvousHandler``
on a real etcd (``EmbeddedEtcd``), and torch's handler on kelastic's etcd backend
(``create_torch_handler``, i.e. ``torchrun --rdzv-backend=kelastic-etcd``).
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: torch's handler does not start the workers'
shared TCPStore, which kelastic's handler does not do either.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from .common import (
    CaseResult,
    Check,
    LineReader,
    Row,
    child_env,
    embedded_etcd,
    log,
    median,
    save_partial,
    stop_process,
)

os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"


def _quiet() -> None:
    import logging

    logging.basicConfig(level=logging.ERROR)
    for name in ("torch.distributed.elastic", "kelastic_sidecar"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _timed_join(joins: list[Callable[[], Any]]) -> float:
    """Start all ``joins`` at once on threads; seconds until the last one returned."""
    go = threading.Event()
    ends: list[float] = []
    errors: list[BaseException] = []

    def run(join: Callable[[], Any]) -> None:
        go.wait()
        try:
            join()
            ends.append(time.monotonic())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(j,), daemon=True) for j in joins]
    for t in threads:
        t.start()
    time.sleep(0.05)
    t0 = time.monotonic()
    go.set()
    for t in threads:
        t.join(120)
    if errors or len(ends) != len(joins):
        raise RuntimeError(f"{len(errors)} joins failed: {errors[:1]!r}")
    return max(ends) - t0


def _ours_join(endpoint: str, n: int, counts: dict[str, int] | None = None) -> float:
    """min = max = ``n`` handlers (threads) join one round; seconds until the last joined.

    ``counts``, when given, receives the etcd requests sent during the join, by
    operation (the stores' :meth:`~kelastic_etcd.EtcdClient.request_counts`).
    """
    from kelastic.contract import Keys, job_prefix
    from kelastic_etcd import EtcdClient
    from kelastic_sidecar.rendezvous import EtcdRendezvousHandler, RendezvousSettings

    run_id = uuid.uuid4().hex[:12]
    prefix = job_prefix("bench", f"join-{n}", run_id)
    settings = RendezvousSettings(run_id=run_id, min_nodes=n, max_nodes=n, join_timeout=60)
    stores = [EtcdClient([endpoint]) for _ in range(n)]
    handlers = []
    try:
        for i, store in enumerate(stores):
            store.get("/warm-up")  # the channel is connected, as in a running sidecar
            handlers.append(EtcdRendezvousHandler(store, Keys(prefix), f"node-{i}", settings))
        before = [store.request_counts() for store in stores]
        for h in handlers:  # the session (lease, watch), opened when a sidecar starts, as
            h.open()  # torch's side connects its TCPStore first; both are in ``counts``
        took = _timed_join([h.next_rendezvous for h in handlers])
        if counts is not None:  # the etcd requests each store sent during the join
            for store, was in zip(stores, before, strict=True):
                for name, count in store.request_counts().items():
                    counts[name] = counts.get(name, 0) + count - was.get(name, 0)
        return took
    finally:
        for h in handlers:
            with contextlib.suppress(Exception):
                h.shutdown()
        with contextlib.suppress(Exception):
            stores[0].delete_prefix(prefix)
        for store in stores:
            store.close()


def _torch_c10d_join(server_port: int, n: int) -> float:
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousTimeout,
    )

    run_id = uuid.uuid4().hex[:12]
    handlers = []
    try:
        for _ in range(n):
            store = dist.TCPStore(
                "127.0.0.1", server_port, is_master=False, timeout=timedelta(seconds=60)
            )
            backend = C10dRendezvousBackend(store, run_id)
            handlers.append(
                DynamicRendezvousHandler.from_backend(
                    run_id,
                    store,
                    backend,
                    n,
                    n,
                    local_addr="127.0.0.1",
                    timeout=RendezvousTimeout(join=timedelta(seconds=60)),
                )
            )
        return _timed_join([h.next_rendezvous for h in handlers])
    finally:
        _torch_shutdown(handlers)


def _torch_shutdown(handlers: list[Any]) -> None:
    for h in handlers:
        with contextlib.suppress(Exception):
            h._stop_heartbeats()
    if handlers:
        with contextlib.suppress(Exception):
            handlers[0].shutdown()  # closes the run for all


def _torch_etcd_join(endpoint: str, n: int) -> float:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from kelastic_sidecar.torchrun_plugin import create_torch_handler

    run_id = uuid.uuid4().hex[:12]
    handlers = []
    try:
        for _ in range(n):
            params = RendezvousParameters(
                backend="kelastic-etcd",
                endpoint=endpoint,
                run_id=run_id,
                min_nodes=n,
                max_nodes=n,
                local_addr="127.0.0.1",
                join_timeout=60,
            )
            handlers.append(create_torch_handler(params))
        return _timed_join([h.next_rendezvous for h in handlers])
    finally:
        _torch_shutdown(handlers)
        for h in handlers:
            with contextlib.suppress(Exception):
                h._state_holder._backend._inner._store.close()


def _ours_join_counts(endpoint: str, n: int) -> dict[str, int]:
    """One more join of ours; the etcd requests it sent, by operation."""
    counts: dict[str, int] = {}
    _ours_join(endpoint, n, counts)
    return counts


#: the sides of a join: (name, ``module:function`` called with (store or etcd, N), ref)
JOIN_SIDES = (
    ("torch handler + c10d (TCPStore)", "bench.rdzv_cases:_torch_c10d_join", True),
    ("kelastic handler + etcd", "bench.rdzv_cases:_ours_join", False),
    ("torch handler + kelastic etcd backend", "bench.rdzv_cases:_torch_etcd_join", False),
)
#: seconds each side may take per run at one N (its deadline: this times its runs)
JOIN_RUN_BUDGET = 20.0


def _join_note(n: int, counts: dict[str, int]) -> tuple[str, dict[str, float]]:
    per_node = {k: round(v / n, 1) for k, v in sorted(counts.items())}
    total = sum(v for k, v in counts.items() if k != "cas_failed") / n
    note = (
        f"N={n}: {total:.1f} etcd requests per node until joined "
        f"(CAS {per_node.get('cas', 0)}, of which failed {per_node.get('cas_failed', 0)};"
        f" reads {per_node.get('read', 0)}; alive put+read {per_node.get('put_read', 0)};"
        f" watch streams {per_node.get('watch', 0) + per_node.get('wait_change', 0)};"
        f" lease grants {per_node.get('grant_lease', 0)}; the stream and the grant"
        " are the session, opened before the timed window)"
    )
    return note, per_node


def join(quick: bool) -> CaseResult:
    """min = max = N nodes (threads of one helper process) join one round; time to the
    last. Each side at each N runs in :class:`~bench.sides.SideRunner` with its own
    deadline (``BENCH_SIDE_DEADLINE`` s, default :data:`JOIN_RUN_BUDGET` per run): a
    side that times out or fails costs its own row (and its rows at larger N, where it
    is not run again after a time-out); every row is logged and saved as it arrives."""
    import torch.distributed as dist

    from .sides import SideRunner

    _quiet()
    result = CaseResult("rdzv_join")
    ns = (2,) if quick else (2, 4, 8, 16, 32, 64)
    ours_reps, torch_reps = (2, 1) if quick else (5, 3)
    fixed = os.environ.get("BENCH_SIDE_DEADLINE")
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timed_out: dict[str, int] = {}  # side -> the N it timed out at
    with embedded_etcd() as endpoint, SideRunner("rdzv_join") as runner:
        for n in ns:
            group = f"N={n} join (start -> round complete on all)"
            for side, fn, ref in JOIN_SIDES:
                reps = torch_reps if side.startswith("torch") else ours_reps
                where: str | int = server.port if "c10d" in side else endpoint
                if side in timed_out:
                    status = f"not run: timed out at N={timed_out[side]}"
                    samples: list[float] = []
                else:
                    deadline = float(fixed) if fixed else JOIN_RUN_BUDGET * reps
                    log(f"rdzv_join: N={n}: {side} x{reps} (deadline {deadline:g} s)")
                    values, status = runner.run(side, fn, [where, n], reps, deadline)
                    samples = [float(v) * 1000 for v in values]
                    if status.startswith("timed out"):
                        timed_out[side] = n
                row = Row("rdzv_join", group, side, "ms", samples, ref=ref, status=status)
                result.rows.append(row)
                log(f"rdzv_join: N={n}: {side}: median {median(samples):.1f} ms"
                    + (f" ({status})" if status else ""))  # fmt: skip
                save_partial(result)
            ours = next(r for r in result.rows if r.group == group and r.side == JOIN_SIDES[1][0])
            if ours.samples:  # one more run of ours, counting its etcd calls
                deadline = float(fixed) if fixed else JOIN_RUN_BUDGET
                got, status = runner.run("etcd request count", "bench.rdzv_cases:_ours_join_counts",
                                         [endpoint, n], 1, deadline)  # fmt: skip
                if got:
                    ours.note, per_node = _join_note(n, got[0])
                    ours.extra["etcd_calls_per_node"] = per_node
                else:
                    ours.note = f"N={n}: etcd requests not counted: {status}"
                save_partial(result)
    n = 32 if 32 in ns else ns[-1]  # the target is set at N = 32
    ours = next(r for r in result.rows if r.group.startswith(f"N={n} ") and "kelastic h" in r.side)
    med = median(ours.samples)
    if not quick:
        value = f"{med:.0f} ms" if ours.samples else ours.status
        result.checks.append(
            Check("rdzv_join", "kelastic median <= 100 ms at N = 32", value, med <= 100)
        )
    return result


# ------------------------------------------------------------------- re-rendezvous


def _start_node(
    impl: str, name: str, endpoint: str, run_id: str, conf: dict[str, Any]
) -> tuple[subprocess.Popen[str], LineReader]:
    args = [sys.executable, "-m", "bench._rdzv_node", impl, name, endpoint, run_id]
    args += [str(conf["min"]), str(conf["max"]), str(conf["ttl"]), str(conf["last_call"])]
    proc = subprocess.Popen(
        args,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
        start_new_session=True,
    )
    return proc, LineReader(proc)


def _send(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def _rejoin_once(impl: str, endpoint: str, mode: str, conf: dict[str, Any]) -> float:
    """3 nodes, min = max = 2: two form a round, the third waits as a spare. SIGKILL a
    participant; seconds from the kill until both survivors are in the next round."""
    run_id = uuid.uuid4().hex[:12]
    names = [f"node-{i}" for i in range(3)]
    nodes = [_start_node(impl, name, endpoint, run_id, conf) for name in names]
    try:
        for _, reader in nodes:
            doc = json.loads(reader.get(60.0))
            assert doc["ev"] == "ready", doc
        for proc, _ in nodes:
            _send(proc, "join")
        members: dict[int, dict[str, Any]] = {}  # node index -> round event
        deadline = time.monotonic() + 30
        while len(members) < 2:
            for i, (_, reader) in enumerate(nodes):
                with contextlib.suppress(TimeoutError):
                    members[i] = json.loads(reader.get(0.05))
            if time.monotonic() > deadline:
                raise TimeoutError("the first round did not complete in 30 s")
        first_round = max(m["round"] for m in members.values())
        time.sleep(1.5 if impl == "torch" else 0.3)  # the spare settles on the redundancy list
        victim = next(i for i, m in members.items() if m["rank"] == 1)
        survivors = [i for i in range(3) if i != victim]
        if mode == "evict":  # connected before the kill, like the operator's client
            from kelastic.contract import Keys, job_prefix
            from kelastic_etcd import EtcdClient

            evictor = EtcdClient([endpoint])
            evictor.get("/warm-up")
            alive_key = Keys(job_prefix("bench", "rejoin", run_id)).alive(names[victim])
        os.kill(nodes[victim][0].pid, signal.SIGKILL)
        killed_at = time.time()
        if mode == "evict":  # what the operator does when it sees the pod fail
            evictor.delete(alive_key)
            evictor.close()
        if impl == "torch":
            for i in survivors:
                if i in members:
                    _send(nodes[i][0], "restart")  # its workers' collectives just failed
        done: dict[int, float] = {}
        deadline = time.monotonic() + 40
        while len(done) < 2:
            for i in survivors:
                with contextlib.suppress(TimeoutError):
                    doc = json.loads(nodes[i][1].get(0.02))
                    if doc["ev"] == "round" and doc["round"] > first_round:
                        done[i] = doc["t"]
            if time.monotonic() > deadline:
                raise TimeoutError("no new round within 40 s of the kill")
        return max(done.values()) - killed_at
    finally:
        for proc, _ in nodes:
            stop_process(proc, grace=0.5)


def rejoin(quick: bool) -> CaseResult:
    """Re-rendezvous after SIGKILL of one node (processes)."""
    import torch.distributed as dist

    _quiet()
    result = CaseResult("rdzv_rejoin")
    group = "SIGKILL of a participant -> next round on both survivors"
    reps = 1 if quick else 4
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    torch_conf = {"min": 2, "max": 2, "ttl": 1, "last_call": 1.0}
    ours_conf = {"min": 2, "max": 2, "ttl": 1, "last_call": 1.0}
    sides = [
        ("torch c10d, keep-alive 1 s (x3 attempts)", "torch", "lease", torch_conf, True),
        ("kelastic, lease expiry (TTL 1 s)", "kelastic", "lease", ours_conf, False),
        ("kelastic, operator eviction (alive key deleted)", "kelastic", "evict", ours_conf, False),
    ]
    with embedded_etcd() as endpoint:
        for side, impl, mode, conf, ref in sides:
            where = f"127.0.0.1:{server.port}" if impl == "torch" else endpoint
            samples = []
            for rep in range(reps):
                log(f"rdzv_rejoin: {side}: rep {rep + 1}/{reps}")
                samples.append(_rejoin_once(impl, where, mode, conf) * 1000)
            result.rows.append(Row("rdzv_rejoin", group, side, "ms", samples, ref=ref))
    for row in result.rows[1:]:
        med = median(row.samples)
        result.checks.append(
            Check("rdzv_rejoin", f"<= 1 s from the kill: {row.side}", f"{med:.0f} ms", med <= 1000)
        )
    return result


# --------------------------------------------------------------------------- scale


def scale(quick: bool) -> CaseResult:
    """N = 128 and 256 nodes (threads of this process) join one round, min = max = N."""
    import torch.distributed as dist

    _quiet()
    result = CaseResult("rdzv_scale")
    ns = (128,) if quick else (128, 256)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with embedded_etcd() as endpoint:
        for n in ns:
            group = f"N={n} join, one process (start -> round complete on all)"
            log(f"rdzv_scale: N={n}: torch handler + c10d (TCPStore), join timeout 60 s")
            try:
                samples, note = [_torch_c10d_join(server.port, n)], ""
            except RuntimeError as exc:
                samples, note = [], f"N={n}: did not complete: {exc}"[:200]
            result.rows.append(
                Row("rdzv_scale", group, "torch handler + c10d (TCPStore)", "s", samples,
                    ref=True, note=note)
            )  # fmt: skip
            log(f"rdzv_scale: N={n}: kelastic handler + etcd")
            counts: dict[str, int] = {}
            took = _ours_join(endpoint, n, counts)
            per_node = {k: round(v / n, 1) for k, v in sorted(counts.items())}
            total = sum(v for k, v in counts.items() if k != "cas_failed") / n
            result.rows.append(
                Row("rdzv_scale", group, "kelastic handler + etcd", "s", [took],
                    note=f"N={n}: {total:.1f} etcd requests per node ({per_node})",
                    extra={"etcd_calls_per_node": per_node})
            )  # fmt: skip
            result.checks.append(
                Check("rdzv_scale", f"kelastic completes at N={n}", f"{took:.1f} s", True)
            )
    return result
