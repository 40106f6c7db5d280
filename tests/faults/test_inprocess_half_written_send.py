"""A peer's send half written into this rank when it aborts (real torch gloo, CPU).

gloo fails the operations a connection has queued when it closes, except an
unbound-buffer send already in its write queue: a peer whose send waits for room in
this rank's receive window when this rank's teardown shuts the connection down waits
for that send until the process group's timeout. It happened with two ranks raising at
once: a third rank's collective failed on a raiser's connection, gloo there dropped its
receive buffers and stopped reading the fourth rank's ring send, and the fourth rank
stayed in ``loss.backward()`` until the sidecar's hard timeout killed it (20.5 s to all
ranks stepping instead of 0.6-0.8 s). Made deterministic here: the receiver posts a
receive and drops it (gloo stops reading that connection, as after a failed
collective), the sender sends more than the socket buffers hold, and the receiver tears
down with :func:`kelastic.inprocess.abort.shutdown_connections`: the half-written send
must end, instead of waiting for the group's 120 s timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

from kelastic import contract
from kelastic_operator.local.etcd import free_port
from tests.prereq import require_module
from tests.worker_lib.test_inprocess_harness import Log, ev

ROOT = Path(__file__).resolve().parents[2]

#: Floats sent: 64 MiB, far more than loopback's socket buffers hold.
ELEMENTS = 16 * 1024 * 1024
#: Seconds the sender's send may take to end after the teardown (it ends in
#: milliseconds; the group's own timeout is 120 s).
SEND_END_BOUND = 30.0

RANK_SCRIPT = """
    import datetime, gc, json, os, sys, time
    import torch, torch.distributed as dist
    from kelastic.inprocess import abort

    RANK = int(os.environ["RANK"])
    FLAGS = os.environ["KL_DIR"]

    def emit(event, **kw):
        print(json.dumps({"event": event, "rank": RANK, "t": time.time(), **kw}), flush=True)

    def wait_flag(name):
        while not os.path.exists(os.path.join(FLAGS, name)):
            time.sleep(0.005)

    before = abort.snapshot()
    dist.init_process_group("gloo", rank=RANK, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    n = int(os.environ["KL_ELEMENTS"])
    if RANK == 0:  # the sender
        wait_flag("send")
        work = dist.isend(torch.ones(n), 1)
        emit("sending")
        try:
            work.wait()
            emit("send_ended", how="completed")
        except Exception as exc:
            emit("send_ended", how=type(exc).__name__, what=str(exc)[:200])
    else:  # the receiver: a receive posted, then dropped (its buffer freed)
        work = dist.irecv(torch.empty(n), 0)
        del work
        gc.collect()
        emit("dropped")
        # what gloo no longer reads piles up in the socket until the window is full
        last, since = -1, time.monotonic()
        while True:
            socks = [abort._connection(fd, None, True) for fd in abort._new_socket_fds(before)]
            unread = sum(abort._unread(s) for s in socks if s is not None)
            for s in socks:
                if s is not None:
                    s.close()
            if unread != last:
                last, since = unread, time.monotonic()
            elif unread > 0 and time.monotonic() - since > 0.2:
                break
            time.sleep(0.01)
        emit("stalled", unread=unread)
        wait_flag("teardown")
        emit("tore_down", shut=abort.shutdown_connections(before))
    wait_flag("exit")
"""


def _pump(stream: Any, log: Log, sink: list[str] | None) -> None:
    for line in stream:
        if sink is not None:
            sink.append(line)
            continue
        try:
            log.add({"src": "worker", **json.loads(line)})
        except ValueError:
            log.add({"src": "worker", "event": "text", "line": line.rstrip()})


def test_a_teardown_lets_a_peers_half_written_send_end(tmp_path: Path) -> None:
    require_module("torch")
    log = Log()
    port = free_port()
    procs: list[subprocess.Popen[str]] = []
    errs: list[list[str]] = [[], []]
    try:
        for rank in range(2):
            env = {**os.environ, "PYTHONPATH": f"{ROOT / 'worker_lib'}{os.pathsep}{ROOT}",
                   contract.RANK: str(rank), contract.WORLD_SIZE: "2",
                   contract.MASTER_ADDR: "127.0.0.1", contract.MASTER_PORT: str(port),
                   "KL_DIR": str(tmp_path), "KL_ELEMENTS": str(ELEMENTS),
                   "OMP_NUM_THREADS": "1"}  # fmt: skip
            proc = subprocess.Popen(
                [sys.executable, "-c", textwrap.dedent(RANK_SCRIPT)], env=env, text=True,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )  # fmt: skip
            procs.append(proc)
            for stream, sink in ((proc.stdout, None), (proc.stderr, errs[rank])):
                threading.Thread(target=_pump, args=(stream, log, sink), daemon=True).start()
        log.wait(ev("dropped", rank=1), timeout=120, what="the receive posted and dropped")
        (tmp_path / "send").touch()
        log.wait(ev("sending", rank=0), timeout=60, what="the send started")
        stalled = log.wait(ev("stalled", rank=1), timeout=60, what="the receiver's window full")
        assert stalled["unread"] > 0
        teardown_at = time.time()
        (tmp_path / "teardown").touch()
        log.wait(ev("tore_down", rank=1), timeout=60, what="the teardown")
        try:
            ended = log.wait(ev("send_ended", rank=0), timeout=SEND_END_BOUND,
                             what="the half-written send ending")  # fmt: skip
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nsender stderr:\n{''.join(errs[0])[-3000:]}") from None
        print(f"\nhalf-written send of {ELEMENTS * 4 >> 20} MiB ({stalled['unread']} bytes "
              f"unread at the receiver): {ended['how']} "
              f"{ended['t'] - teardown_at:.3f} s after the teardown began")  # fmt: skip
    finally:
        (tmp_path / "exit").touch()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
