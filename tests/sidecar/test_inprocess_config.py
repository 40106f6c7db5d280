"""In-process restarts as the supervisor sees them: config from env, the ``assign`` a
round sends, ``/status``, and a disabled coordinator that does nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from kelastic import contract
from kelastic.control_messages import Assign, WorkerAssignment
from kelastic_etcd import EtcdClient
from kelastic_sidecar.config import ConfigError, InProcessSettings, SidecarConfig
from kelastic_sidecar.inprocess.coordinator import InProcessCoordinator
from kelastic_sidecar.inprocess.record import IterationRecord, encode_iteration_record
from kelastic_sidecar.metrics import SidecarMetrics
from kelastic_sidecar.rendezvous.state import RendezvousInfo
from kelastic_sidecar.supervisor import Supervisor
from kelastic_sidecar.timer import TimerStats

GOOD = {
    contract.ENV_JOB_NAME: "digits",
    contract.ENV_JOB_UID: "u1",
    contract.ENV_POD_NAME: "digits-0",
    contract.ENV_ETCD_ENDPOINTS: "127.0.0.1:2379",
    contract.ENV_MIN_NODES: "1",
    contract.ENV_MAX_NODES: "2",
}


def test_config_from_env() -> None:
    assert SidecarConfig.from_env(GOOD).inprocess == InProcessSettings()
    assert not InProcessSettings().enabled
    cfg = SidecarConfig.from_env({
        **GOOD, contract.ENV_INPROCESS: "1", contract.ENV_INPROCESS_MAX_RESTARTS: "3",
        contract.ENV_INPROCESS_SOFT_TIMEOUT: "5", contract.ENV_INPROCESS_HARD_TIMEOUT: "7.5",
    })  # fmt: skip
    assert cfg.inprocess == InProcessSettings(True, 3, 5.0, 7.5)
    assert cfg.inprocess.barrier_timeout == 12.5
    with pytest.raises(ConfigError) as err:
        SidecarConfig.from_env({**GOOD, contract.ENV_INPROCESS_HARD_TIMEOUT: "x"})
    assert f"{contract.ENV_INPROCESS_HARD_TIMEOUT}='x' is not a valid float" in str(err.value)
    with pytest.raises(ConfigError) as err:
        SidecarConfig.from_env({
            **GOOD, contract.ENV_INPROCESS: "1", contract.ENV_INPROCESS_MAX_RESTARTS: "-1",
            contract.ENV_INPROCESS_SOFT_TIMEOUT: "nan", contract.ENV_INPROCESS_HARD_TIMEOUT: "9",
        })  # fmt: skip
    text = str(err.value)
    assert f"{contract.ENV_INPROCESS_MAX_RESTARTS} must be >= 0" in text
    assert f"{contract.ENV_INPROCESS_SOFT_TIMEOUT} must be > 0 seconds" in text
    with pytest.raises(ConfigError, match="must be above"):
        SidecarConfig.from_env({**GOOD, contract.ENV_INPROCESS_SOFT_TIMEOUT: "90"})


def _assign() -> Assign:
    workers = tuple(WorkerAssignment(lr, {contract.RANK: str(2 + lr)}) for lr in range(2))
    return Assign(attempt=3, round=5, workers=workers)


def test_begin_round_gives_the_workers_the_jobs_iteration(
    store: EtcdClient, job_prefix: str, tmp_path: Path
) -> None:
    keys = contract.Keys(job_prefix)
    store.put(keys.inprocess_iteration, encode_iteration_record(IterationRecord(7, 4, 7)))
    metrics = SidecarMetrics(lambda: TimerStats())
    on = InProcessSettings(enabled=True)
    coord = InProcessCoordinator(on, store, keys, "b", metrics, tmp_path, "127.0.0.1")
    coord.start()
    try:
        info = RendezvousInfo(round=5, group_rank=1, group_world_size=2, participants=("a", "b"))
        assign = coord.begin_round(_assign(), info, None)
        assert [w.env[contract.ENV_INPROCESS_ITERATION] for w in assign.workers] == ["7", "7"]
        assert [w.env[contract.RANK] for w in assign.workers] == ["2", "3"]
        assert (assign.attempt, assign.round) == (3, 5)
        status = coord.status()
        assert status == {
            "enabled": True, "iteration": 7, "restarts": 7, "max_restarts": on.max_restarts,
            "phase": "running", "respawns": 0, "last": None, "earlier": [], "corrupt": None,
            "carried": 0, "held": False,
            "spares": {"configured": 0, "pids": {}, "promoted": 0, "waiting": []},
        }  # fmt: skip
        coord.end_round("succeeded")
        assert coord.status()["phase"] == "idle"  # type: ignore[index]
    finally:
        coord.close()
    assert not contract.inprocess_socket_path(tmp_path).exists()


def test_disabled_changes_nothing_and_status_says_none(
    store: EtcdClient, job_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(contract.ENV_RUN_DIR, str(tmp_path))
    cfg = SidecarConfig.from_env(GOOD)
    supervisor = Supervisor(cfg, store)
    assert supervisor.status()["inprocess"] is None
    coord = supervisor.inprocess
    coord.start()  # no socket, no thread
    assert not contract.inprocess_socket_path(tmp_path).exists()
    info = RendezvousInfo(round=1, group_rank=0, group_world_size=1, participants=("a",))
    assign = _assign()
    assert coord.begin_round(assign, info, None) is assign
    coord.end_round("failed")
    coord.close()
    supervisor.control.close()
