"""spec.preflight.network with real processes (``kelastic run``): each round's nodes run the
gloo check (one real ``python -m kelastic.netcheck`` per node, started ahead by its
launcher) after the rendezvous and before the workers start.

A slow node: the first checker to claim a flag file has torch's collectives and
point-to-point calls slowed (a ``sitecustomize`` on the trainer's ``PYTHONPATH``, active
only in the checker: the network of one machine cannot be slowed for one process
otherwise). Its own check names it; it leaves the round and its Pod fails with the
preflight prefix (replaced, nothing charged); the two others rendezvous again and train;
the replacement (whose checker is not slowed) joins and the next round's check passes."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import wait_for
from tests.localrun import KelasticRun, write_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

#: Slows the first checker to claim ``$SLOW_CHECKER_FLAG``: every send, receive and
#: all-reduce waits 0.3 s (its latency misses a 100 ms floor, its 1 MiB round trip 5 MB/s).
SLOW = textwrap.dedent(
    """
    import os, sys
    if sys.orig_argv[1:3] == ["-m", "kelastic.netcheck"]:
        flag = os.environ["SLOW_CHECKER_FLAG"]
        try:
            os.rename(flag, flag + ".claimed")
        except FileNotFoundError:
            pass
        else:
            import time
            import torch.distributed as dist

            def slow(call):
                def slowed(*args, **kwargs):
                    time.sleep(0.3)
                    return call(*args, **kwargs)
                return slowed

            for name in ("send", "recv", "all_reduce"):
                setattr(dist, name, slow(getattr(dist, name)))
            print("this network checker is slowed", file=sys.stderr, flush=True)
    """
)
NETWORK = {"maxLatencyMilliseconds": 100, "minBandwidthMBps": 5, "sizeMiB": 1, "iterations": 3,
           "timeoutSeconds": 20}  # fmt: skip


def _job(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW)
    flag = tmp_path / "slow-checker"
    flag.touch()
    env = {"STEPS_STOP_FILE": str(tmp_path / "stop"), "PYTHONPATH": str(site),
           "SLOW_CHECKER_FLAG": str(flag)}  # fmt: skip
    path = write_job(tmp_path / "job.yaml", replicas=3, min_replicas=2, max_restarts=0, env=env,
                     pod_replacement={"maxReplacements": 2, "backoffSeconds": 0})  # fmt: skip
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    doc["spec"]["preflight"] = {"network": NETWORK}
    path.write_text(yaml.safe_dump(doc))
    return path


def test_a_slow_node_is_named_by_the_check_and_the_round_forms_without_it(
    tmp_path: Path,
) -> None:
    run = KelasticRun(_job(tmp_path), workdir=tmp_path / "runs")
    wait_for(lambda: run.has("replaced (replacement 1)"), 240, what=f"replaced:\n{run.output}")
    wait_for(lambda: run.has("world size 3") and run.has("[2]: rank=2 world=3"), 180,
             what=f"the replacement trains:\n{run.output}")  # fmt: skip
    run.finish(tmp_path / "stop", rank=2)
    out = run.output
    assert "job succeeded" in out and run.restarts_charged() == 0, out
    # the slow node's own Pod said why (its trainer's termination message)
    (termlog,) = (tmp_path / "runs").glob("steps-*/pods/steps-*.replaced-1/trainer.termination-log")
    text = termlog.read_text()
    assert text.startswith("preflight failed on steps-"), text
    assert "network check of round" in text and "failed every pair test" in text, text
    # the slowed checker ran once; the others were told, then passed with the replacement
    assert out.count("this network checker is slowed") == 1, out
    assert f"failed: its trainer exited with code 1 ({text[:100]}" in out, out
    bad = termlog.parent.name.split(".")[0]
    pods = termlog.parent.parent
    for good in sorted({"steps-0", "steps-1", "steps-2"} - {bad}):
        text = (pods / good / "kelastic-sidecar.log").read_text()
        assert "round 0 network check" in text and "failed the network check" in text, text
        assert "rendezvous again without them" in text and "passed: all-reduce" in text, text
    assert run.strays() == []
