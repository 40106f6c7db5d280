"""Real torch gloo ranks wrapped by the real :class:`kelastic.inprocess.Wrapper`, on two
"nodes" whose sidecar coordinators agree through a real etcd: a rank raising on one node
restarts every rank of both in-process (no process restarts) and the job finishes."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator

from kelastic import contract
from kelastic_etcd import EtcdClient
from kelastic_operator.local.etcd import free_port
from tests.conftest import wait_for
from tests.prereq import require_module
from tests.sidecar.inprocess_harness import Node, make_node, sample
from tests.worker_lib.test_inprocess_harness import ROOT, WORKER, Log, ev

require_module("torch")

NODES = ("node-a", "node-b")
NPROC = 2


@contextlib.contextmanager
def _workers(
    nodes: tuple[Node, ...], env: dict[str, str], log: Log
) -> Iterator[list[subprocess.Popen[str]]]:
    port = free_port()
    procs: list[subprocess.Popen[str]] = []

    def pump(stream: object) -> None:
        import json

        for line in stream:  # type: ignore[attr-defined]
            with contextlib.suppress(ValueError):
                log.add({"src": "worker", **json.loads(line)})

    try:
        for node in nodes:
            assert node.ctx is not None
            for local_rank in range(NPROC):
                worker_env = {
                    **os.environ, **{k: str(v) for k, v in node.ctx.envs[local_rank].items()},
                    "PYTHONPATH": f"{ROOT / 'worker_lib'}{os.pathsep}{ROOT}",
                    contract.ENV_RUN_DIR: str(node.run_dir), "KL_DIR": str(node.run_dir),
                    contract.MASTER_ADDR: "127.0.0.1", contract.MASTER_PORT: str(port),
                    contract.ENV_INPROCESS: "1", contract.ENV_INPROCESS_ITERATION: "0",
                    "OMP_NUM_THREADS": "1", **env,
                }  # fmt: skip
                proc = subprocess.Popen(
                    [sys.executable, "-c", WORKER], env=worker_env, cwd=node.run_dir,
                    text=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                )  # fmt: skip
                procs.append(proc)
                threading.Thread(target=pump, args=(proc.stdout,), daemon=True).start()
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def test_a_raise_on_one_node_restarts_both_nodes_in_process(
    etcd_endpoint: str, job_prefix: str
) -> None:
    store = EtcdClient([etcd_endpoint])
    log = Log()
    env = {"KL_GLOO": "1", "KL_STEPS": "8", "KL_FAULT_3": "0:3", "KL_DO_3": "raise"}
    try:
        with (
            make_node(NODES[0], store, job_prefix, "127.0.0.1") as a,
            make_node(NODES[1], store, job_prefix, "127.0.0.1") as b,
        ):
            for group_rank, node in enumerate((a, b)):
                node.begin(1, group_rank, NODES, nproc=NPROC, connect=False, master=False)
            with _workers((a, b), env, log) as procs:
                raised = log.wait(ev("raising", rank=3), what="rank 3 raising")
                entered = [
                    log.wait(ev("enter", rank=r, iteration=1), what=f"rank {r} in iteration 1")
                    for r in range(4)
                ]
                codes = [p.wait(timeout=120) for p in procs]
            assert codes == [0, 0, 0, 0]
            for r in range(4):
                assert log.wait(ev("result", rank=r))["value"] == {"iteration": 1, "rank": r}
            ports = {e["port"] for e in entered}
            assert len(ports) == 1  # one MASTER_PORT for iteration 1, from node a's ready key
            took = max(e["t"] for e in entered) - raised["t"]
            print(f"\nraise -> all 4 gloo ranks of 2 nodes in iteration 1: {took * 1000:.0f} ms")
            for node in (a, b):
                wait_for(
                    lambda n=node: sample(n.metrics, "kelastic_inprocess_restart_seconds_count"),
                    30, what="every local rank progressed in iteration 1",
                )  # fmt: skip
                node.flush()
                restarts = {"level": "inprocess", "cause": "worker_failure"}
                assert sample(node.metrics, "kelastic_restarts_total", **restarts) == 1
                status = node.coordinator.status()
                # the cause is the fault that won the record: rank 3's raise, or a peer's
                # "connection closed" it caused when that peer's sidecar was quicker
                assert status is not None and status["last"]["cause"] == "exception"
                print(f"{node.name}: cause recorded: rank {status['last']['rank']}: "
                      f"{status['last']['message'][:60]}")  # fmt: skip
                resumed = status["last"]["resumed_s"]
                print(f"{node.name}: abort -> every local rank progressed: {resumed * 1000:.0f} ms")
    finally:
        store.close()
