"""Fault matrix: scale during training (a new node joins a running job).

A scale-up costs no restart: the running round re-forms with the new node at the next
round, from the checkpoint.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kelastic_operator.local.runner import LocalOptions, LocalRunner
from kelastic_operator.model import load_manifest
from tests.conftest import wait_for
from tests.localrun import STEP_LINE, write_job


def test_a_new_node_joins_at_the_next_round_without_a_restart(tmp_path: Path) -> None:
    stop, ckpt = tmp_path / "stop", tmp_path / "ckpt"
    job = load_manifest(write_job(
        tmp_path / "job.yaml", replicas=2, min_replicas=2, max_replicas=3, nproc=1,
        env={"STEPS_STOP_FILE": str(stop), "STEPS_CHECKPOINT": str(ckpt)},
    ))  # fmt: skip
    lines: list[tuple[float, str]] = []

    def has(text: str) -> bool:
        return any(text in x for _, x in list(lines))

    runner = LocalRunner(
        job, tmp_path, LocalOptions(workdir=tmp_path / "runs", stop_grace=2, status_interval=2),
        say=lambda line: lines.append((time.monotonic(), f"[kelastic] {line}")),
        echo=lambda line, _err: lines.append((time.monotonic(), line)),
    )  # fmt: skip
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(runner.run()), daemon=True)
    thread.start()
    try:
        wait_for(lambda: has("world=2 round=0"), 60, what="round 0")
        wait_for(lambda: has("[0]: step 10"), 60, what="training")
        # Called from this thread: the run thread starts the processes (they die with it).
        assert runner.add_replica() == "steps-2"
        wait_for(lambda: has("world=3"), 60, what="a round of 3 nodes")
        wait_for(lambda: has("world size 3 (3 nodes x 1), restarts 0/3"), 30,
                 what="the runner's progress line for the round of 3")  # fmt: skip
        with pytest.raises(RuntimeError, match="maxReplicas"):
            runner.add_replica()
        # Each sidecar serves its probes, metrics and status on one port.
        for pod in runner.pods:
            base = f"http://127.0.0.1:{pod.http_port}"
            assert _get(base + "/healthz") == (200, "ok\n")
            wait_for(lambda b=base: _get(b + "/readyz")[0] == 200, 30, what="ready")
            code, metrics = _get(base + "/metrics")
            assert code == 200 and "kelastic_world_size 3.0" in metrics
            rounds = 1 if pod.name == "steps-2" else 2  # the new node joined in round 1
            assert f"kelastic_rendezvous_rounds_total {rounds}.0" in metrics
            assert "kelastic_rendezvous_duration_seconds_count" in metrics
            status = json.loads(_get(base + "/status")[1])
            assert status["group_world_size"] == 3 and status["phase"] == "running"
            assert _get(base + "/nope")[0] == 404
        stop.touch()
        thread.join(60)
        assert result == [0], "\n".join(x for _, x in lines)
    finally:
        runner.interrupt()
        thread.join(30)
    out = "\n".join(x for _, x in lines)
    assert not re.search(r"restart \d+/", out), out  # a scale-up costs no restart
    starts = [int(m.group(1)) for m in re.finditer(r"from_step=(\d+)", out)]
    assert len(starts) == 5 and min(starts[2:]) >= 10, out  # round 1 resumed
    steps = [t for t, x in lines if (m := STEP_LINE.match(x)) and m.group(1) == "0"]
    lost = max(b - a for a, b in itertools.pairwise(steps))
    print(f"\nFAULT scale-up 2->3: rank 0 idle {lost:.2f}s, 0 restarts")
    assert lost < 30


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
