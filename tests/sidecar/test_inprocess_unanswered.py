"""A rank that cannot leave an aborted iteration because it is connecting to a host that
does not answer is killed at once, not at the hard timeout. The host that does not
answer is played by a loopback listener whose accept queue is full: the kernel drops
further SYNs, as a gone node's address does."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator

from kelastic_etcd import EtcdClient
from kelastic_sidecar.inprocess.unanswered import connecting_nowhere, socket_inodes, unanswered
from tests.conftest import wait_for
from tests.sidecar.inprocess_harness import (
    fault_rank_0_and_leave,
    make_node,
    rank_1_process,
    sample,
    settings,
)

HEADER = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid"
          "  timeout inode")  # fmt: skip


def _line(state: str, remote: str, retransmits: int, inode: int) -> str:
    return (f"   0: 0100007F:9C40 {remote} {state} 00000000:00000000 01:00000123 "
            f"{retransmits:08X} 0 0 {inode} 1 0000000000000000 100 0 0 10 0")  # fmt: skip


def test_only_connecting_sockets_of_the_process_that_sent_their_syn_again_count() -> None:
    v4 = "0100007F:1F90"  # 127.0.0.1:8080
    v6 = "0000000000000000FFFF00000A00000A:0050"  # ::ffff:10.0.0.10 port 80
    v6_plain = "B80D0120000000000000000001000000:01BB"  # 2001:db8::1 port 443
    lines = [
        HEADER,
        _line("02", v4, 2, 11),  # SYN_SENT, retransmitted: counts
        _line("02", v4, 0, 12),  # SYN_SENT, first SYN still within its timeout
        _line("01", v4, 3, 13),  # established (its retransmits are data's)
        _line("02", v4, 1, 99),  # another process's socket
        _line("02", v6, 1, 14),  # IPv6, a mapped IPv4 (torch's store client)
        _line("02", v6_plain, 1, 15),
        "garbage", "   1: zz:zz zz:zz 02 x x x x x x", "",  # malformed: skipped
        _line("02", "0100007F:GGGG", 1, 11),
        _line("02", "01007F:1F90", 1, 11),  # an address of no family
    ]  # fmt: skip
    got = unanswered(lines, {11, 12, 13, 14, 15})
    assert got == [("127.0.0.1", 8080), ("10.0.0.10", 80), ("2001:db8::1", 443)]
    assert unanswered(lines, set()) == []
    assert unanswered([], {11}) == []


@contextlib.contextmanager
def _no_answer() -> Iterator[int]:
    """A loopback port whose SYNs the kernel drops (its listener's queue full)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    fill = []
    try:
        for _ in range(3):
            sock = socket.socket()
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect(("127.0.0.1", port))
            fill.append(sock)
        yield port
    finally:
        for sock in [*fill, server]:
            sock.close()


CONNECT = textwrap.dedent(
    """
    import socket, sys
    s = socket.socket()
    print("connecting", flush=True)
    s.connect(("127.0.0.1", int(sys.argv[1])))
    print("connected", flush=True)
    """
)


def test_a_process_connecting_to_a_host_that_does_not_answer_is_seen() -> None:
    with _no_answer() as port:
        proc = subprocess.Popen([sys.executable, "-c", CONNECT, str(port)],
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "connecting"
            assert socket_inodes(proc.pid)  # its socket, read from /proc
            wait_for(lambda: connecting_nowhere(proc.pid) == [("127.0.0.1", port)], 15,
                     what="the SYN sent again, unanswered")  # fmt: skip
            assert connecting_nowhere(99999999) == []  # no such process: nothing
        finally:
            proc.kill()
            proc.wait()


#: A rank (``python -c STUCK SOCKET PORT``): hello as local rank 1, then torch's
#: ``TCPStore`` client connects to PORT (nobody answers), in C++ that no abort reaches,
#: as a rank in ``init_process_group`` for an iteration whose store's node is gone.
STUCK = textwrap.dedent(
    """
    import datetime, json, os, socket, sys
    import torch.distributed as dist
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sys.argv[1])
    hello = {"type": "hello", "pid": os.getpid(), "local_rank": 1, "rank": 1, "iteration": 0}
    s.sendall(json.dumps(hello).encode() + b"\\n")
    print("connected", flush=True)
    dist.TCPStore("127.0.0.1", int(sys.argv[2]), 2, False, datetime.timedelta(seconds=600))
    """
)


def test_a_rank_stuck_connecting_to_a_gone_host_is_killed_before_the_hard_timeout(
    store: EtcdClient, job_prefix: str
) -> None:
    with (
        _no_answer() as port,
        make_node("solo", store, job_prefix, cfg=settings(soft=30.0, hard=120.0)) as n,
    ):
        n.begin(1, 0, ("solo",), connect=False)
        with rank_1_process(n, STUCK, str(port)) as stuck:
            fault_rank_0_and_leave(n)
            assert stuck.wait(timeout=30) == -9  # killed long before the 120 s hard timeout
            assert n.killed == [(stuck.pid, 9)]
            why = (
                f"connecting to 127.0.0.1:{port}, which has not answered for over a second "
                "(its host gone?): it cannot leave for iteration 1; killed by the sidecar"
            )
            assert n.told == [("reap", stuck.pid, why), ("kill", stuck.pid, 9)]
            assert sample(n.metrics, "kelastic_inprocess_workers_killed_total") == 1
