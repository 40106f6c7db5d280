"""Fault matrix: the link to etcd cut for one node, longer than its lease TTL, then
restored.

The cut node's lease expires: its peer counts it lost (one restart, charged to that
node) and waits for it; the cut node, back, finds the round went on without it and
joins the next one. Its Pod is not failed or replaced.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kelastic import contract
from kelastic_operator.local.etcd import EmbeddedEtcd
from tests.conftest import wait_for
from tests.faults.linkcut import LinkCutter
from tests.localrun import KelasticRun, write_job

TTL = 3
CUT = 3 * TTL  # seconds without etcd for one node


@pytest.fixture
def proxy(etcd_server: EmbeddedEtcd) -> Iterator[LinkCutter]:
    with LinkCutter(etcd_server.endpoint) as cutter:
        yield cutter


def test_a_node_cut_off_from_etcd_rejoins_when_the_link_is_back(
    tmp_path: Path, proxy: LinkCutter
) -> None:
    stop, ckpt = tmp_path / "stop", tmp_path / "ckpt"
    job = write_job(
        tmp_path / "job.yaml", replicas=2, nproc=1, lease_ttl=TTL,
        env={"STEPS_STOP_FILE": str(stop), "STEPS_CHECKPOINT": str(ckpt)},
    )  # fmt: skip
    run = KelasticRun(job, "--etcd", proxy.endpoint, workdir=tmp_path / "runs")
    try:
        wait_for(lambda: run.has("[1]: step 10"), 60, what="both nodes training")
        (sidecar,) = [p for p in run.processes("kelastic_sidecar")
                      if p.environ().get(contract.ENV_POD_NAME) == "steps-1"]  # fmt: skip
        proxy.cut(sidecar.pid)
        cut_at = time.monotonic()
        wait_for(lambda: time.monotonic() - cut_at > CUT, CUT + 5, interval=0.2,
                 what="the cut to last")  # fmt: skip
        proxy.restore(sidecar.pid)
        wait_for(lambda: run.has("round 1: world size 2"), 60, what="both nodes in round 1")
        run.finish(stop, rank=1)
    finally:
        run.interrupt()
    out = run.output
    assert re.search(r"restart 1/3: node_lost: node on steps-1 \(round 0\)", out), out
    assert run.restarts_charged() == 1, out
    assert "etcd unreachable: etcd at " in out  # the cut node said so while it lasted
    assert "replacing" not in out and not re.search(r"steps-\d failed", out), out  # no Pod failed
    starts = [int(m.group(1)) for m in re.finditer(r"from_step=(\d+)", out)]
    assert min(starts[2:]) > 0 and int(ckpt.read_text()) > starts[-1]  # resumed, not redone
    lost = run.time_lost(rank=0)
    print(f"\nFAULT etcd-link-cut {CUT}s (TTL {TTL}s): rank 0 idle {lost:.2f}s, 1 restart")
    assert lost < CUT + 20, out
    assert run.strays() == []
