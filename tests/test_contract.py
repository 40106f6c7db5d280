"""The pod contract: key layout and paths every component derives from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kelastic import contract


def test_key_layout_matches_design() -> None:
    keys = contract.Keys(contract.job_prefix("ns", "digits", "u1"))
    assert keys.rdzv_state == "/kelastic/ns/digits/u1/rdzv/state"
    assert keys.alive("digits-0") == "/kelastic/ns/digits/u1/rdzv/alive/digits-0"
    assert keys.master(3) == "/kelastic/ns/digits/u1/rounds/3/master"
    assert keys.restarts == "/kelastic/ns/digits/u1/restarts"
    assert keys.report("digits-1") == "/kelastic/ns/digits/u1/reports/digits-1"
    assert keys.departing("digits-1") == "/kelastic/ns/digits/u1/rdzv/departing/digits-1"
    assert keys.joining("digits-1") == "/kelastic/ns/digits/u1/rdzv/joining/digits-1"


@pytest.mark.parametrize("parts", [("", "j", "u"), ("n", "a/b", "u"), ("n", "j", "")])
def test_job_prefix_rejects_empty_or_slashed_parts(parts: tuple[str, str, str]) -> None:
    with pytest.raises(ValueError, match="must be non-empty"):
        contract.job_prefix(*parts)


def test_keys_need_a_terminated_prefix() -> None:
    with pytest.raises(ValueError, match="end with"):
        contract.Keys("/kelastic/a/b/c")


def test_paths_follow_the_run_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(contract.ENV_RUN_DIR, str(tmp_path))
    assert contract.timer_fifo_path() == tmp_path / "timer.fifo"
    assert contract.control_socket_path() == tmp_path / "control.sock"
    assert contract.worker_log_dir(2, 1) == tmp_path / "logs" / "attempt_2" / "1"
    monkeypatch.delenv(contract.ENV_RUN_DIR)
    assert contract.run_dir() == Path("/var/run/kelastic")


def test_worker_env_uses_torch_names() -> None:
    import torch.distributed.elastic.agent.server.local_elastic_agent as lea  # noqa: F401

    # Every name torch's agent sets for a worker is one we set too.
    torch_names = {
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
        "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR",
        "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_TIMER_FILE",
    }  # fmt: skip
    assert torch_names == set(contract.WORKER_ENV_NAMES)


def test_unix_sockets_work_at_paths_longer_than_sun_path(tmp_path: Path) -> None:
    import socket

    from kelastic.sockaddr import MAX_UNIX_PATH, unix_address

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    path = deep / "control.sock"
    assert len(str(path)) > MAX_UNIX_PATH
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with unix_address(path) as address:
        server.bind(address)
    server.listen(1)
    assert path.exists()  # the socket file lives where the contract says
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with unix_address(path) as address:
        client.connect(address)
    conn, _ = server.accept()
    client.sendall(b"hello")
    assert conn.recv(5) == b"hello"
    for s in (client, conn, server):
        s.close()
    with unix_address(tmp_path / "short.sock") as address:
        assert address == str(tmp_path / "short.sock")


def test_the_operator_reads_what_the_sidecar_writes() -> None:
    """The etcd values cross packages as JSON: the operator's parser is fed the
    sidecar's own encoders, so a renamed field fails here, not on a cluster."""
    from kelastic_operator.rendezvous_store import view_from_keys
    from kelastic_sidecar.failure import Failure
    from kelastic_sidecar.rendezvous.state import RendezvousState, encode_state, mark_complete
    from kelastic_sidecar.restart_budget import RestartRecord, encode_record
    from kelastic_sidecar.supervisor import node_report

    prefix = contract.job_prefix("ns", "j", "u1")
    keys = contract.Keys(prefix)
    state = mark_complete(RendezvousState("u1", round=4, participants={"j-0": 0, "j-1": 1}))
    failure = Failure(cause="worker_failure", node="j-0", round=4, rank=1, exitcode=3)
    kv = {
        keys.rdzv_state: encode_state(state),
        keys.restarts: encode_record(RestartRecord(count=2, last_round=3)),
        keys.report("j-0"): node_report(
            "failed", "j-0", f"{contract.JOB_FAILED_PREFIX} after 2 restarts: boom", failure
        ),
        keys.report("j-1"): node_report("succeeded", "j-1", "done"),
        keys.report("j-2"): node_report("failed", "j-2", "rendezvous failed: timeout"),
    }
    view = view_from_keys(prefix, kv, nproc_per_node=4)
    assert (view.round, view.world_size, view.restarts_spent) == (4, 8, 2)
    assert set(view.failed_reports) == {"j-0"}  # a node's own failure is not the job's
    assert view.succeeded_nodes == frozenset({"j-1"})
