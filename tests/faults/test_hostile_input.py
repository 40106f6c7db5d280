"""Fault matrix, hostile input: crafted values in etcd and on the
control socket are refused as corrupt, counted, and recovered from; no sidecar part
crashes. Real etcd, real sockets, and one row with ``kelastic run``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kelastic_etcd import EtcdClient
from kelastic_sidecar.control import MSG_DISCONNECTED, ControlServer, Hello, Message
from kelastic_sidecar.rendezvous.state import RendezvousStateError, decode_state
from kelastic_sidecar.restart_budget import RestartBudget, decode_record
from tests.conftest import wait_for
from tests.localrun import WORKERS, KelasticRun, run_cli, write_job
from tests.sidecar.test_rendezvous import Cluster, join_all, settings

DEEP = b"[" * 50_000 + b"]" * 50_000


def _state_with(raw_state: bytes, field: str, literal: str) -> bytes:
    doc = json.loads(raw_state)
    doc[field] = "@@"
    return json.dumps(doc).replace('"@@"', literal).encode()


@pytest.fixture
def cluster(etcd_endpoint: str, job_prefix: str) -> Iterator[Cluster]:
    c = Cluster(etcd_endpoint, job_prefix)
    yield c
    c.close()


@pytest.mark.parametrize(
    ("field", "literal"),
    [
        ("round", "9" * 5000),  # ValueError from Python's int-digit limit, before
        ("closed_reason", DEEP.decode()),  # RecursionError, before
        ("deadline", "NaN"),  # accepted, then the next write failed, before
        ("deadline", "1e999"),
        ("participants", '{"job-0": 1000000000000000000000000000000}'),
    ],
    ids=["round-5000-digits", "100KB-brackets", "nan-deadline", "1e999", "rank-10e30"],
)
def test_crafted_state_mid_round_is_replaced_and_the_nodes_re_form(
    cluster: Cluster, field: str, literal: str
) -> None:
    s = settings(min_nodes=2, max_nodes=2, last_call_timeout=0.5)
    nodes = [cluster.node(f"job-{i}", s) for i in range(2)]
    first = join_all(nodes)
    raw, _ = cluster.admin.get(cluster.keys.rdzv_state) or (b"", 0)
    cluster.admin.put(cluster.keys.rdzv_state, _state_with(raw, field, literal))
    with pytest.raises(RendezvousStateError):
        decode_state(cluster.admin.get(cluster.keys.rdzv_state)[0])  # type: ignore[index]
    # The running round sees a fresh state (never an exception) and so ends; the nodes
    # re-form in a round above every round used before, and the key holds a valid state.
    check = nodes[0].check_round(first[0])
    assert not check.healthy
    assert check.reason  # e.g. round_advanced
    again = join_all(nodes)
    assert again[0].round > first[0].round
    assert decode_state(cluster.admin.get(cluster.keys.rdzv_state)[0]).complete  # type: ignore[index]
    assert sum(n.corrupt_states for n in nodes) >= 1


def test_crafted_restart_record_is_replaced_without_refilling_the_budget(
    cluster: Cluster,
) -> None:
    budget = RestartBudget(cluster.admin, cluster.keys, max_restarts=3)
    assert budget.charge(1, "hang", "job-0", {}).count == 1
    repairs: list[int] = []
    budget_b = RestartBudget(cluster.admin, cluster.keys, 3, on_repair=lambda: repairs.append(1))
    assert budget_b.read().count == 1
    cluster.admin.put(cluster.keys.restarts, b'{"version":1,"count":' + b"9" * 5000 + b"}")
    charge = budget_b.charge(2, "hang", "job-0", {})
    assert (charge.count, charge.charged, repairs) == (2, True, [1])  # 1 known + this one
    got = cluster.admin.get(cluster.keys.restarts)
    assert got is not None and decode_record(got[0]).count == 2


def test_hostile_control_lines_are_dropped_and_the_launcher_stays_connected(
    pod_run_dir: Path,
) -> None:
    got: list[Message] = []
    path = pod_run_dir / "control.sock"
    server = ControlServer(path, got.append)
    server.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(str(path))
            for line in (
                DEEP,
                b'{"type": "hello", "pid": ' + b"9" * 5000 + b"}",
                b'{"type": "exited", "attempt": 1, "local_rank": 0, "tail": 7}',
                b'{"type": "started", "attempt": 1, "pids": {"0": [1]}}',
                b'{"type": "exited", "attempt": NaN, "local_rank": 0}',
                b'{"type": "hello", "pid": 10, "nproc": 2}',
            ):
                conn.sendall(line + b"\n")
            wait_for(lambda: any(m.type == "hello" for m in got), 30, what="the valid hello")
            assert server.connected
        assert got[0] == Hello(pid=10, nproc=2)
        assert server.malformed == 5
        wait_for(lambda: got[-1].type == MSG_DISCONNECTED, 30, what="the disconnect")
    finally:
        server.close()


def test_kelastic_run_survives_a_crafted_state_written_mid_training(
    tmp_path: Path, etcd_endpoint: str
) -> None:
    """Before: every sidecar crashed on the crafted state and the job failed within ~1 s
    ("the sidecar closed the control connection"). Now the nodes replace it, re-form
    without charging a restart, resume from the checkpoint and finish."""
    name = f"hostile-{uuid.uuid4().hex[:8]}"
    job = write_job(
        tmp_path / "job.yaml", name=name, replicas=2,
        env={"STEPS_MAX": "120", "STEPS_CHECKPOINT": str(tmp_path / "ckpt")},
    )  # fmt: skip
    run = KelasticRun(job, "--etcd", etcd_endpoint, workdir=tmp_path / "runs")
    admin = EtcdClient([etcd_endpoint])
    try:
        wait_for(lambda: run.has("step 20"), 120, what="workers stepping")
        keys = [k for k in admin.get_prefix("/kelastic/") if f"/{name}/" in k]
        state_key = next(k for k in keys if k.endswith("/rdzv/state"))
        raw = admin.get(state_key)
        assert raw is not None
        crafted = _state_with(raw[0], "round", "9" * 5000)
        hit = time.monotonic()
        admin.put(state_key, crafted)
        assert run.wait(240) == 0, run.output
        print(f"\nFAULT crafted-state: time lost {run.time_lost(0):.2f}s, "
              f"{run.restarts_charged()} restarts")  # fmt: skip
        assert "job succeeded" in run.output
        assert run.restarts_charged() == 0, run.output
        assert any(t > hit for t in run.step_times(0)), "no step after the crafted state"
        got = admin.get(state_key)  # replaced: valid again, a round above the old ones
        assert got is not None and decode_state(got[0]).round > json.loads(raw[0])["round"]
        logs = "".join(p.read_text() for p in (tmp_path / "runs").rglob("kelastic-sidecar.log"))
        assert "replacing it with a fresh state" in logs
        assert run.strays() == []
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
        admin.close()


# ----------------------------------------------- a forged in-process record

#: A forged record: a valid shape, iteration 2**53 (no writer gets there).
FORGED = (b'{"iteration":9007199254740992,"round":0,"restarts":0,"cause":"x","node":"x",'
          b'"rank":1,"message":"forged","time":1}')  # fmt: skip
_PID = re.compile(r"^\[(\d)\]:? ?pid (\d+) start iteration (\d+)$", re.M)
_ENTER = re.compile(r"^\[(\d)\]:? ?pid (\d+) enter iteration (\d+)$", re.M)


def _inprocess_job(tmp: Path, name: str) -> tuple[Path, Path]:
    """A 2 x 1 job of ``tests/workers/wrapped_steps.py`` (no torch) with in-process restart
    on and SIGUSR1 raising in the wrapped function; returns the manifest and stop file."""
    stop = tmp / "stop"
    job = write_job(
        tmp / "job.yaml", name=name, replicas=2, nproc=1,
        command=["python", str(WORKERS / "wrapped_steps.py")],
        env={"STEPS_STOP_FILE": str(stop), "KELASTIC_INJECT_RAISE": "1"},
    )  # fmt: skip
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["inProcess"] = {"enabled": True, "maxRestarts": 10,
                                "softTimeoutSeconds": 10, "hardTimeoutSeconds": 20}  # fmt: skip
    job.write_text(yaml.safe_dump(doc))
    return job, stop


def _pid_of(run: KelasticRun, rank: int) -> int:
    pids = [int(p) for r, p, _ in _PID.findall(run.output) if int(r) == rank]
    assert pids, run.output
    return pids[-1]


def _record_key(admin: EtcdClient, name: str) -> str:
    """The job's in-process record key (``<prefix>/inprocess/iteration``)."""
    keys = [k for k in admin.get_prefix("/kelastic/") if f"/{name}/" in k]
    state = next(k for k in keys if k.endswith("/rdzv/state"))
    return state[: -len("rdzv/state")] + "inprocess/iteration"


def _runner_lines(run: KelasticRun) -> list[str]:
    """``kelastic run``'s own lines (not the workers', not the periodic status)."""
    return [ln for ln in list(run.lines)
            if ln.startswith("[kelastic]") and not ln.startswith("[kelastic] status:")]  # fmt: skip


def _stepping(run: KelasticRun, ranks: range, after: int) -> bool:
    """Every rank of ``ranks`` took a step after output line ``after``."""
    tail = run.lines[after:]
    return all(any(ln.startswith(f"[{r}]: step ") for ln in tail) for r in ranks)


def test_a_forged_inprocess_record_is_refused_and_in_process_restart_still_works(
    tmp_path: Path, etcd_endpoint: str
) -> None:
    """Before: the sidecars took iteration 2**53, every rank aborted
    with no fault, ``kelastic run`` printed ``in-process restart (iteration N): see the
    sidecar logs`` for every N up to 2**53 and never returned. Now every reader refuses
    the record as corrupt, ``kelastic run`` says so once, the raise that follows is an
    in-process restart (the record replaced), a second one works too, and the job
    succeeds with no line said twice."""
    name = f"forged-{uuid.uuid4().hex[:8]}"
    job, stop = _inprocess_job(tmp_path, name)
    run = KelasticRun(job, "--etcd", etcd_endpoint, "--in-process", workdir=tmp_path / "runs")
    admin = EtcdClient([etcd_endpoint])
    try:
        wait_for(lambda: _stepping(run, range(2), 0), 120, what="both ranks stepping")
        pids = {r: _pid_of(run, r) for r in range(2)}
        admin.put(_record_key(admin, name), FORGED)
        wait_for(lambda: run.has("corrupt"), 60, what=f"the corrupt record reported:\n{run.output}")
        mark = len(run.lines)
        os.kill(pids[1], signal.SIGUSR1)
        wait_for(lambda: run.has("in-process restart 1/10"), 60,
                 what=f"the in-process restart:\n{run.output}")  # fmt: skip
        wait_for(lambda: _stepping(run, range(2), mark), 60, what="stepping again")
        mark = len(run.lines)
        os.kill(pids[1], signal.SIGUSR1)
        wait_for(lambda: run.has("in-process restart 2/10"), 60,
                 what=f"the second in-process restart:\n{run.output}")  # fmt: skip
        wait_for(lambda: _stepping(run, range(2), mark), 60, what="stepping again")
        stop.touch()
        assert run.wait(60) == 0, run.output
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
            run.wait(30)
        admin.close()
    out = run.output
    assert "job succeeded" in out, out
    assert run.restarts_charged() == 0, out  # both raises restarted in process
    assert {r: _pid_of(run, r) for r in range(2)} == pids, out  # the same processes
    said = _runner_lines(run)
    assert len(said) == len(set(said)), [ln for ln in said if said.count(ln) > 1][:5]
    assert "see the sidecar logs" not in out, out
    corrupt = [ln for ln in said if "corrupt" in ln]
    assert len(corrupt) == 1 and "in-process record" in corrupt[0], corrupt
    assert run.strays() == []


def test_ctrl_c_stops_kelastic_run_whatever_the_inprocess_record_holds(
    tmp_path: Path, etcd_endpoint: str
) -> None:
    """A forged record, then a raise, then Ctrl-C.
    Before: "stopping the job" was printed and nothing stopped (SIGKILL needed)."""
    name = f"forged-{uuid.uuid4().hex[:8]}"
    job, _ = _inprocess_job(tmp_path, name)
    run = KelasticRun(job, "--etcd", etcd_endpoint, "--in-process", workdir=tmp_path / "runs")
    admin = EtcdClient([etcd_endpoint])
    try:
        wait_for(lambda: _stepping(run, range(2), 0), 120, what="both ranks stepping")
        admin.put(_record_key(admin, name), FORGED)
        os.kill(_pid_of(run, 1), signal.SIGUSR1)
        wait_for(lambda: run.has("(iteration "), 60, what=f"the raise reported:\n{run.output}")
        run.proc.send_signal(signal.SIGINT)
        try:
            code = run.proc.wait(30)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"Ctrl-C did not stop kelastic run:\n{run.output[-3000:]}"
            ) from None
        assert code == 130, run.output
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait(30)
        admin.close()
    wait_for(lambda: run.strays() == [], 30, what="every process gone")


# ------------------------------------- bad input to kelastic run


@pytest.mark.parametrize(
    "endpoint",
    ["not a host:port:::", "etcd:99999", "etcd:0", "ftp://etcd:2379", ":2379", "et cd:2379",
     "[::1:2379", "host:port", "127.0.0.1:2379,bad host:1"],
)  # fmt: skip
def test_kelastic_run_refuses_a_bad_etcd_endpoint_in_one_line(
    tmp_path: Path, endpoint: str
) -> None:
    """Before: ``--etcd 'not a host:port:::'`` started the job, whose sidecars retried
    that "endpoint" forever. Now: exit 2, one line naming it, nothing started."""
    job = write_job(tmp_path / "job.yaml")
    try:
        out = run_cli(str(job), "--etcd", endpoint, "--workdir", str(tmp_path / "runs"),
                      timeout=30)  # fmt: skip
    except subprocess.TimeoutExpired:
        raise AssertionError(f"--etcd {endpoint!r} was not refused: the job ran") from None
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert len(lines) == 1 and lines[0].startswith("kelastic run: --etcd"), lines
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (bytes(range(256)) * 4, "not UTF-8"),
        (b"\xff\xfe\x00binary", "not UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000, "nested"),
        (b"kind: ElasticJob\x00\n", "not valid YAML"),
        (b"kind: ElasticJob\nspec: [1, 2]\n", "invalid ElasticJob"),
    ],
    ids=["binary", "utf16-bom", "100k-brackets", "nul", "bad-spec"],
)
def test_every_manifest_error_names_the_file(tmp_path: Path, content: bytes, says: str) -> None:
    """Before: a binary manifest was refused as ``'utf-8' codec can't decode byte 0xb7 in
    position 0`` (no file named) and a deeply nested one with a RecursionError traceback.
    Now every manifest error is one ``kelastic run: <file>: ...`` report, exit 2."""
    path = tmp_path / "hostile.yaml"
    path.write_bytes(content)
    out = run_cli(str(path))
    assert out.returncode == 2, (out.stdout, out.stderr[-2000:])
    first = out.stderr.strip().splitlines()[0]
    assert first.startswith(f"kelastic run: {path}: "), out.stderr[-2000:]
    assert says in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
