"""Fault matrix: a Pod taken away mid-training, stopped as the kubelet stops it.

The kubelet's order, played here on the real processes of ``kelastic run``: the
trainer's ``preStop`` hook (``python -m kelastic.prestop``) first, then SIGTERM to the
trainer (its launcher), then to the sidecar. What the operator does meanwhile is played
too: for a Pod a disruption takes (its ``DisruptionTarget`` condition: ``kubectl
drain``, a preemption) it posts the node's departure notice ``disruption``, then takes
the node out of the rendezvous.

- a disruption, the notice there before the hook or arriving while the sidecar waits
  for it: the node leaves first with it, the peer re-forms, nothing is charged;
- no notice (``kubectl delete pod``): the sidecar waits
  :data:`~kelastic.contract.PRESTOP_NOTICE_SECONDS`, leaves as ``shutdown``, and the peer
  charges the departure as a lost node: the no-charge above is the notice's doing.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from kelastic import contract
from kelastic_operator.rendezvous_store import EtcdRendezvousStore
from tests.conftest import wait_for
from tests.localrun import KelasticRun, write_job

pytestmark = pytest.mark.timeout(300)


def _sidecar_of(run: KelasticRun, pod: str) -> psutil.Process:
    for proc in run.processes("kelastic_sidecar"):
        if proc.environ().get(contract.ENV_POD_NAME) == pod:
            return proc
    raise AssertionError(f"no sidecar of {pod}:\n{run.output}")


def _launcher_of(run: KelasticRun, run_dir: str) -> psutil.Process:
    for proc in run.processes("kelastic.launch"):
        if proc.environ().get(contract.ENV_RUN_DIR) == run_dir:
            return proc
    raise AssertionError(f"no launcher with run dir {run_dir}:\n{run.output}")


def _store(env: dict[str, str]) -> tuple[EtcdRendezvousStore, str]:
    prefix = contract.job_prefix(
        env[contract.ENV_NAMESPACE], env[contract.ENV_JOB_NAME], env[contract.ENV_JOB_UID]
    )
    return EtcdRendezvousStore(env[contract.ENV_ETCD_ENDPOINTS].split(","), timeout=2.0), prefix


@pytest.mark.parametrize(
    ("notice", "charged"),
    [("before", False), ("while-waiting", False), ("none", True)],
    ids=["disruption-notice-first", "disruption-notice-late", "no-notice"],
)
def test_a_terminating_pod_leaves_first_and_a_disruption_charges_nothing(
    tmp_path: Path, notice: str, charged: bool
) -> None:
    job = write_job(
        tmp_path / "job.yaml", replicas=2, min_replicas=1, max_replicas=2, max_restarts=3,
        env={"STEPS_MAX": "400", "STEPS_CHECKPOINT": str(tmp_path / "ckpt")},
        pod_replacement={"maxReplacements": 2, "backoffSeconds": 0},
    )  # fmt: skip
    run = KelasticRun(job, workdir=tmp_path / "runs")
    try:
        wait_for(lambda: run.has("[0]: step 20") and run.has("[1]: step 20"), 90,
                 what="both nodes training")  # fmt: skip
        env = _sidecar_of(run, "steps-1").environ()
        run_dir = env[contract.ENV_RUN_DIR]
        launcher = _launcher_of(run, run_dir)
        store, prefix = _store(env)

        def operator_pass() -> None:  # a disruption: the notice, then the node taken out
            store.mark_departing(prefix, ["steps-1"], contract.DEPARTURE_DISRUPTION)
            store.remove_nodes(prefix, ["steps-1"])

        late = threading.Timer(1.5, operator_pass)  # the operator's latency: the scenario
        if notice == "before":
            store.mark_departing(prefix, ["steps-1"], contract.DEPARTURE_DISRUPTION)
        elif notice == "while-waiting":
            late.start()
        # the kubelet: the trainer's preStop hook, and only then SIGTERM to the trainer
        started = time.monotonic()
        hook = subprocess.run(
            [sys.executable, "-m", "kelastic.prestop", "--socket",
             str(contract.prestop_socket_path(Path(run_dir)))],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        took = time.monotonic() - started
        if late.is_alive() or notice == "while-waiting":
            late.join(30)
        if notice == "before":
            store.remove_nodes(prefix, ["steps-1"])
        assert hook.returncode == 0, hook
        reason = "shutdown" if notice == "none" else contract.DEPARTURE_DISRUPTION
        assert f"left the rendezvous ({reason})" in hook.stdout, (hook, run.output)
        if notice == "none":  # it waited for a notice that never came
            assert took >= contract.PRESTOP_NOTICE_SECONDS - 0.5, took
        with contextlib.suppress(psutil.NoSuchProcess):
            launcher.send_signal(signal.SIGTERM)  # the kubelet's next step
        assert run.wait(240) == 0, run.output
    finally:
        run.interrupt()
    out = run.output
    assert run.restarts_charged() == (1 if charged else 0), out
    if charged:
        assert "node_lost" in out and "steps-1 (shutdown)" in out, out
