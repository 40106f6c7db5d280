"""The next iteration's c10d store, awaited on every rank but 0 before its
``init_process_group`` (:func:`wait_for_store`; the in-process session's barrier)."""

from __future__ import annotations

import os
import socket
import struct
import sys
import time

from kelastic import contract

__all__ = ["STORE_WAIT", "wait_for_store"]

#: Seconds to wait for the next iteration's store to listen (then torch's timeout).
STORE_WAIT = 10.0
_RESET_ON_CLOSE = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close sends RST


def wait_for_store(timeout: float = STORE_WAIT) -> None:
    """On every rank but 0: wait (at most ``timeout`` seconds) until the iteration's
    c10d store at ``MASTER_ADDR:MASTER_PORT`` accepts connections. Rank 0 creates it in
    its ``init_process_group``; a peer that connects first is refused, and torch's store
    client then backs off for up to a second (measured: 0.5-0.7 s added to 2 of 5
    restarts). A refused probe here is retried every few milliseconds instead. Nothing to
    wait for when the function never imported ``torch.distributed``.

    A probe that connected to itself is no store: ``MASTER_PORT`` is often an ephemeral
    port, and a probe of ``127.0.0.1:P`` whose kernel-chosen source port is ``P`` meets
    itself (TCP simultaneous open) while nothing listens. It is reset, not closed: a
    closed one would hold ``P`` in TIME_WAIT for a minute, and rank 0's bind with it."""
    if os.environ.get(contract.RANK, "0") == "0" or "torch.distributed" not in sys.modules:
        return
    addr, port = os.environ.get(contract.MASTER_ADDR), os.environ.get(contract.MASTER_PORT)
    if not addr or not port or not port.isdigit():
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((addr, int(port)), timeout=0.1) as conn:
                if conn.getsockname() != conn.getpeername():
                    return
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
        except OSError:
            pass
        time.sleep(0.003)
