"""One rendezvous node in its own process, driven by the re-rendezvous benchmark.

``python -m bench._rdzv_node kelastic NAME ETCD RUN_ID MIN MAX LEASE_TTL LAST_CALL``
``python -m bench._rdzv_node torch NAME STORE_HOST:PORT RUN_ID MIN MAX KEEP_ALIVE LAST_CALL``

Prints ``{"ev": "ready"}`` once set up, joins on the stdin command ``join``, and prints
``{"ev": "round", "round", "rank", "size", "t"}`` (``t``: ``time.time()``) each time a
round completes for it.

After a round, a kelastic node watches etcd like the sidecar's supervisor does (an etcd
watch, then ``check_round``) and re-rendezvouses by itself when the round is unhealthy.
A torch node re-rendezvouses when told ``restart`` on stdin: the harness sends it at
the kill, standing in for the instant failure of its workers' collectives (the fastest
way torchrun's agent can learn of a dead peer), or when torch's ``num_nodes_waiting()``
(polled every 0.1 s, like torchrun's monitor loop) says nodes wait.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time

_print_lock = threading.Lock()


def emit(**doc: object) -> None:
    with _print_lock:
        print(json.dumps(doc), flush=True)


def kelastic_node(argv: list[str]) -> None:
    name, endpoint, run_id = argv[0], argv[1], argv[2]
    min_nodes, max_nodes, ttl, last_call = int(argv[3]), int(argv[4]), int(argv[5]), float(argv[6])
    from kelastic.contract import Keys, job_prefix
    from kelastic_etcd import EtcdClient
    from kelastic_sidecar.rendezvous import EtcdRendezvousHandler, RendezvousSettings

    store = EtcdClient([endpoint], timeout=5.0)
    store.get("/warm-up")
    keys = Keys(job_prefix("bench", "rejoin", run_id))
    settings = RendezvousSettings(
        run_id=run_id,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        join_timeout=120,
        last_call_timeout=last_call,
        lease_ttl=ttl,
    )
    handler = EtcdRendezvousHandler(store, keys, name, settings)
    handler.open()  # the session (lease, watch), opened when the sidecar starts
    emit(ev="ready")

    def rendezvous_forever() -> None:
        while True:
            info = handler.next_rendezvous()
            emit(ev="round", round=info.round, rank=info.group_rank, size=info.group_world_size,
                 t=time.time())  # fmt: skip
            while True:  # the supervisor's watch loop
                if not handler.check_round(info).healthy:
                    break
                handler.wait_for_change(1.0)

    for line in sys.stdin:
        if line.strip() == "join":
            threading.Thread(target=rendezvous_forever, daemon=True).start()


def torch_node(argv: list[str]) -> None:
    name, endpoint, run_id = argv[0], argv[1], argv[2]
    min_nodes, max_nodes, keep_alive, last_call = (
        int(argv[3]), int(argv[4]), int(argv[5]), float(argv[6])
    )  # fmt: skip
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousTimeout,
    )

    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    host, port = endpoint.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=120))
    backend = C10dRendezvousBackend(store, run_id)
    handler = DynamicRendezvousHandler.from_backend(
        run_id,
        store,
        backend,
        min_nodes,
        max_nodes,
        local_addr=name,
        timeout=RendezvousTimeout(
            join=timedelta(seconds=120), last_call=timedelta(seconds=last_call)
        ),
        keep_alive_interval=keep_alive,
    )
    restart = threading.Event()
    restart.set()  # the first join
    emit(ev="ready")

    def agent() -> None:
        while True:
            restart.wait()
            restart.clear()
            info = handler.next_rendezvous()
            emit(ev="round", round=handler._state_holder.state.round, rank=info.rank,
                 size=info.world_size, t=time.time())  # fmt: skip
            while not restart.wait(0.1):  # torchrun's monitor loop (monitor_interval 0.1)
                if handler.num_nodes_waiting() > 0:
                    restart.set()

    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "join":
            threading.Thread(target=agent, daemon=True).start()
        elif cmd == "restart":
            restart.set()


def main() -> int:
    logging.basicConfig(level=logging.ERROR)
    impl = sys.argv[1]
    (kelastic_node if impl == "kelastic" else torch_node)(sys.argv[2:])
    return 0


if __name__ == "__main__":
    os._exit(main())  # daemon threads may be blocked in etcd or TCPStore calls
