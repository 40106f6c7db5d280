"""Step-time stragglers end to end: ``kelastic run`` of a 1 x 2 steps job (real etcd,
sidecar, launcher, ``tests/workers/steps.py``) whose local rank 1 takes 0.2 s per timed
step and rank 0 0.05 s. The sidecar, from the timer requests alone, names rank 1 a
straggler in its ``/status`` (``step_times``), its log and ``kelastic_stragglers_total``,
records the steps in ``kelastic_step_seconds``, and writes the verdict to etcd for the
operator (``stragglers/<node>``, by the value's codec; the run uses the session's etcd so
the test can read it). The run says the episode, and the sidecar's kept last status
(``kelastic.last_status``) holds it."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kelastic.etcd_values import StragglersDoc, decode_stragglers
from kelastic.last_status import LAST_STATUS_NAME, read_last_status
from kelastic_etcd import EtcdClient
from tests.conftest import wait_for
from tests.localrun import KelasticRun, write_job


def _sidecar_log(runs: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(runs.glob("*/pods/*/kelastic-sidecar.log")))


def _get(port: int, path: str) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
        return bytes(resp.read())


def _samples(port: int) -> dict[str, float]:
    text = _get(port, "/metrics").decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def _verdicts(etcd_endpoint: str) -> list[StragglersDoc]:
    with EtcdClient([etcd_endpoint]) as store:
        found = store.get_prefix("/kelastic/")
    return [decode_stragglers(value) for key, (value, _) in found.items() if "/stragglers/" in key]


def test_a_slow_rank_is_named_a_straggler_in_status_log_and_metrics(
    tmp_path: Path, etcd_endpoint: str
) -> None:
    stop = tmp_path / "stop"
    job = write_job(
        tmp_path / "job.yaml", replicas=1, nproc=2, max_restarts=0,
        env={"STEPS_STOP_FILE": str(stop), "STEPS_SLOW_RANK": "1", "STEPS_SLOW_SECONDS": "0.2"},
    )  # fmt: skip
    runs = tmp_path / "runs"
    run = KelasticRun(job, "--etcd", etcd_endpoint, workdir=runs)
    try:
        found = wait_for(
            lambda: re.search(r"http :(\d+)", _sidecar_log(runs)), 60, 0.2, "the sidecar's port"
        )
        port = int(found.group(1))

        def straggling() -> dict[str, Any] | None:
            doc = json.loads(_get(port, "/status"))["step_times"]
            return doc if doc["stragglers"] else None

        # rank 1 needs 20 steps of 0.2 s (min_steps' default) before it is judged
        steps = wait_for(straggling, 60, 0.5, "a straggler in /status")
        assert [s["local_rank"] for s in steps["stragglers"]] == [1], steps
        assert steps["stragglers"][0]["ratio"] > 1.5, steps
        slowest = steps["slowest"]
        assert slowest["local_rank"] == 1 and slowest["ratio_to_node_median"] > 1.5, steps
        assert {r["local_rank"] for r in steps["ranks"]} == {0, 1}, steps
        samples = _samples(port)
        assert samples["kelastic_stragglers_total"] >= 1.0, samples
        assert samples["kelastic_step_seconds_count"] >= 40, samples  # both ranks' steps
        assert "straggler: local rank 1's median step" in _sidecar_log(runs)
        # what the operator reads: the node's verdict, written as the episode began
        (doc,) = wait_for(lambda: [d for d in _verdicts(etcd_endpoint) if d["stragglers"]],
                          30, 0.2, "the verdict in etcd")  # fmt: skip
        assert doc["node"] == "steps-0" and doc["stragglers"][0]["local_rank"] == 1, doc
        stop.touch()
        assert run.wait(60) == 0, run.output
        said = (r"straggler on steps-0: local rank 1's median step 0\.\d+ s \(scope 'step'\) "
                r"is \d+\.\d+x its node's other ranks'")  # fmt: skip
        assert re.search(said, run.output), run.output
        # said even when the episode began after the run's last poll (CI, a loaded machine:
        # 0.3 s before the end): the sidecar kept its last status as it exited
        (kept,) = runs.glob("*/pods/steps-0/volumes/kelastic-run/" + LAST_STATUS_NAME)
        last = read_last_status(kept.parent)
        assert last is not None and last["phase"] == "succeeded", last
        assert [s["local_rank"] for s in last["step_times"]["stragglers"]] == [1], last
    finally:
        run.interrupt()
    assert run.strays() == []
