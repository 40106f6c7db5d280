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
    from kelastic_operator.etcd_view import view_from_keys
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


# ------------------------- each etcd value: one side's encoder, the other side's decoder


class _Store:
    """The part of the etcd client the writers use, over a dict (revision per write)."""

    def __init__(self) -> None:
        self.kv: dict[str, tuple[bytes, int]] = {}
        self.revision = 0

    def get(self, key: str) -> tuple[bytes, int] | None:
        return self.kv.get(key)

    def put(self, key: str, value: bytes) -> None:
        self.revision += 1
        self.kv[key] = (value, self.revision)

    def wait_value(self, key: str, timeout: float) -> bytes:
        return self.kv[key][0]

    def cas(self, key: str, value: bytes, expected: int | None) -> tuple[bool, bytes | None, int]:
        current = self.kv.get(key)
        if (current[1] if current else None) != expected:
            return False, *(current or (None, 0))
        self.put(key, value)
        return True, value, self.revision

    def values(self) -> dict[str, bytes]:
        return {key: value for key, (value, _) in self.kv.items()}


PREFIX = contract.job_prefix("ns", "j", "u1")
KEYS = contract.Keys(PREFIX)


def test_the_sidecars_read_the_departure_notice_the_operator_writes() -> None:
    from kelastic.etcd_values import decode_departure
    from kelastic_operator.rendezvous_store import EtcdRendezvousStore
    from kelastic_sidecar.rendezvous.state import (
        RendezvousSettings,
        RendezvousState,
        decode_state,
        encode_state,
        mark_complete,
        sanitize,
    )

    store = _Store()
    operator = EtcdRendezvousStore.__new__(EtcdRendezvousStore)
    operator._client = store  # type: ignore[assignment]
    operator.endpoints = ("etcd:2379",)
    operator.mark_departing(PREFIX, ["j-1"], contract.DEPARTURE_SCALE_DOWN)
    raw = store.values()[KEYS.departing("j-1")]
    assert decode_departure(raw) == contract.DEPARTURE_SCALE_DOWN
    with pytest.raises(ValueError, match="departure reason"):
        operator.mark_departing(PREFIX, ["j-1"], "x" * 2000)  # the strict writer
    # a notice no writer produced (too long) is cut by the readers: the state the
    # sidecar then writes is one its own reader accepts
    settings = RendezvousSettings(run_id="u1", min_nodes=1, max_nodes=2)
    state = mark_complete(RendezvousState("u1", participants={"j-0": 0, "j-1": 0}))
    for notice in (raw, b"x" * 5000, b"\xff\xfe"):
        after, _ = sanitize(state, ["j-0"], settings, {"j-1": decode_departure(notice)})
        assert decode_state(encode_state(after)).departed["j-1"] == decode_departure(notice)


def test_the_peers_read_the_master_address_group_rank_0_writes() -> None:
    from kelastic_sidecar.supervisor import round_master

    store = _Store()
    key = KEYS.master(4)
    addr, port = round_master(store, key, "127.0.0.1", publish=True, timeout=1)  # type: ignore[arg-type]
    assert round_master(store, key, "10.9.9.9", publish=False, timeout=1) == (addr, port)  # type: ignore[arg-type]
    assert addr == "127.0.0.1" and 0 < port < 65536


def test_the_operator_reads_the_restart_record_the_budget_writes() -> None:
    from kelastic_operator.etcd_view import view_from_keys
    from kelastic_sidecar.failure import Failure
    from kelastic_sidecar.restart_budget import RestartBudget

    store = _Store()
    budget = RestartBudget(store, KEYS, max_restarts=3)  # type: ignore[arg-type]
    failure = Failure(cause="hang", node="j-0", round=2, rank=1, signal=9, tail=("a",))
    assert budget.charge(2, failure.cause, "j-0", failure.as_dict()).charged
    assert budget.charge(3, "node_lost", "j-1", {}).count == 2
    view = view_from_keys(PREFIX, store.values(), nproc_per_node=2)
    assert view.restarts_spent == 2 == budget.read().count


def test_a_charge_the_codec_refuses_to_write_is_a_restart_record_error() -> None:
    """A charge whose record would be over the codec's 2 MiB (a huge failure detail) is
    refused before it is written, as the budget's own error (the supervisor logs it)."""
    from kelastic_sidecar.restart_budget import RestartBudget, RestartRecordError

    store = _Store()
    budget = RestartBudget(store, KEYS, max_restarts=3)  # type: ignore[arg-type]
    with pytest.raises(RestartRecordError, match="refusing to write"):
        budget.charge(1, "worker_failure", "j-0", {"message": "x" * (3 << 20)})
    assert store.values() == {} and budget.charge(1, "hang", "j-0", {}).count == 1


def test_the_operator_reads_the_inprocess_record_the_sidecar_writes() -> None:
    from kelastic_operator.etcd_view import view_from_keys
    from kelastic_sidecar.inprocess.record import Advance, RestartCause, advance_iteration

    store = _Store()
    outcome = advance_iteration(
        store, KEYS.inprocess_iteration, 0, 5, round_=1, cause=RestartCause.EXCEPTION,
        node="j-0", rank=3, message="ValueError: boom", now=1.7e9,
    )  # fmt: skip
    assert outcome.kind is Advance.ADVANCED
    record = view_from_keys(PREFIX, store.values(), nproc_per_node=2).inprocess
    assert record is not None
    assert (record.iteration, record.restarts, record.cause, record.node, record.rank) == (
        1, 1, "exception", "j-0", 3,
    )  # fmt: skip


def test_the_operator_reads_every_report_the_sidecar_writes() -> None:
    from kelastic.etcd_values import MAX_SUMMARY, ReportOutcome, decode_report
    from kelastic_operator.etcd_view import view_from_keys
    from kelastic_sidecar.supervisor import node_report

    long = f"{contract.JOB_FAILED_PREFIX}: " + "x" * (2 * MAX_SUMMARY)
    kv = {KEYS.report(f"j-{o.value}"): node_report(o, f"j-{o.value}", long) for o in ReportOutcome}
    view = view_from_keys(PREFIX, kv, nproc_per_node=2)
    assert view.failed_reports == {"j-failed": long[:MAX_SUMMARY]}  # cut by the writer
    assert view.succeeded_nodes == frozenset({"j-succeeded"})
    for raw in kv.values():
        assert len(decode_report(raw)["summary"]) == MAX_SUMMARY  # the strict reader too


def test_a_value_no_writer_produces_is_refused_by_every_reader_and_every_writer() -> None:
    import json

    from kelastic import etcd_values
    from kelastic_operator.etcd_view import view_from_keys
    from kelastic_sidecar.rendezvous.state import (
        CorruptStateError,
        RendezvousState,
        RendezvousStateError,
        decode_state,
        encode_state,
    )
    from kelastic_sidecar.restart_budget import (
        CorruptRecordError,
        RestartRecord,
        RestartRecordError,
        decode_record,
        encode_record,
    )
    from kelastic_sidecar.supervisor import node_report

    state = json.loads(encode_state(RendezvousState("u1", round=2**53, complete=True)))
    restarts = json.loads(encode_record(RestartRecord(count=1)))
    report = json.loads(node_report("failed", "j-0", "job failed: x"))
    forged = {
        KEYS.rdzv_state: json.dumps({**state, "round": 2**53 + 1}).encode(),
        KEYS.restarts: json.dumps({**restarts, "count": -1}).encode(),
        KEYS.report("j-0"): json.dumps({**report, "outcome": "exploded"}).encode(),
    }
    with pytest.raises(CorruptStateError):
        decode_state(forged[KEYS.rdzv_state])
    with pytest.raises(CorruptRecordError):
        decode_record(forged[KEYS.restarts])
    with pytest.raises(etcd_values.CorruptValueError):
        etcd_values.decode_report(forged[KEYS.report("j-0")], partial=True)
    view = view_from_keys(PREFIX, forged, nproc_per_node=2)
    assert (view.round, view.world_size, view.restarts_spent, dict(view.failed_reports)) == (
        None, None, None, {},
    )  # fmt: skip
    for state in (RendezvousState("u1", round=2**53 + 1), RendezvousState("u1", lost={""})):
        with pytest.raises(RendezvousStateError, match="refusing to write"):
            encode_state(state)
    with pytest.raises(RestartRecordError, match="refusing to write"):
        encode_record(RestartRecord(count=-1))
    for write in (
        lambda: node_report("failed", "", "x"),
        lambda: etcd_values.encode_master("", 29500),
        lambda: etcd_values.encode_master("10.0.0.1", 0),
        lambda: etcd_values.encode_departure(""),
    ):
        with pytest.raises(etcd_values.CorruptValueError):
            write()
