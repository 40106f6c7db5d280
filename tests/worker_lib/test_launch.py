"""``python -m kelastic.launch`` against a real supervisor: real processes, sockets, signals.

The test plays the sidecar: it listens on the control socket, speaks the JSON-lines
protocol and checks what the launcher reports, what its workers saw, what they wrote
and that nothing outlives the launcher.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import pytest

from kelastic import contract
from tests.conftest import wait_for

MARKER = "KL_TEST_MARKER"

# One worker program; what it does is chosen per local rank by KL_MODE_<local_rank>.
WORKER = textwrap.dedent(
    r"""
    import json, os, signal, subprocess, sys, time
    from kelastic.errors import record

    local_rank = os.environ["LOCAL_RANK"]
    rank = os.environ.get("RANK", "?")
    mode = os.environ.get("KL_MODE_" + local_rank, "ok")

    def ready():
        print("ready", flush=True)

    def sleep_forever():
        while True:
            time.sleep(60)

    def on_term(signum, frame):
        sys.stderr.write("got SIGTERM\n")
        sys.stderr.flush()
        if mode != "ignore_term":
            os._exit(0)

    @record
    def main():
        signal.signal(signal.SIGTERM, on_term)
        if mode == "ok":
            out = os.path.join(os.environ["KL_OUT_DIR"], f"env_{local_rank}.json")
            with open(out, "w") as fp:
                json.dump(dict(os.environ), fp)
            print(f"out line from rank {rank}")
            sys.stderr.write(f"err line from rank {rank}\n")
            sys.stderr.write(f"partial from rank {rank}")  # no newline: the last line
            return
        if mode == "fail":
            for i in range(30):
                print(f"noise {i}", file=sys.stderr)
            raise ValueError(f"boom from rank {rank}")
        if mode in ("sleep", "ignore_term"):
            ready()
            sleep_forever()
        if mode == "spawn":  # a grandchild in the worker's own process group
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            print(f"child {child.pid}", flush=True)
            ready()
            sleep_forever()
        if mode == "escape":  # a grandchild in its own session, orphaned at once
            child = subprocess.Popen(
                [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
            )
            print(f"child {child.pid}", flush=True)
            return
        raise SystemExit(f"unknown mode {mode}")

    def torch_main():
        from torch.distributed.elastic.multiprocessing.errors import record as torch_record

        @torch_record
        def run():
            raise RuntimeError(f"torch boom from rank {rank}")

        run()

    torch_main() if mode == "torch_fail" else main()
    """
)


# ------------------------------------------------------------------------- helpers
class Supervisor:
    """A minimal sidecar: one Unix stream socket server speaking JSON lines."""

    def __init__(self, run_dir: Path) -> None:
        self.path = contract.control_socket_path(run_dir)
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(self.path))
        self.server.listen(1)
        self.conn: socket.socket | None = None
        self._buf = b""

    def accept(self, timeout: float = 30.0) -> None:
        self.server.settimeout(timeout)
        self.conn, _ = self.server.accept()

    def send_raw(self, data: bytes) -> None:
        assert self.conn is not None
        self.conn.sendall(data)

    def send(self, obj: dict[str, Any]) -> None:
        self.send_raw((json.dumps(obj) + "\n").encode())

    def recv(self, timeout: float = 30.0) -> dict[str, Any] | None:
        """The next message, or None if the launcher closed the connection."""
        assert self.conn is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no message from the launcher within {timeout}s")
            self.conn.settimeout(left)
            try:
                data = self.conn.recv(65536)
            except TimeoutError:
                continue
            if not data:
                return None
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        assert len(line) < contract.CONTROL_MAX_LINE
        msg = json.loads(line)
        assert isinstance(msg, dict)
        return msg

    def expect(self, kind: str, timeout: float = 30.0) -> dict[str, Any]:
        msg = self.recv(timeout)
        assert msg is not None, f"connection closed while waiting for {kind!r}"
        assert msg["type"] == kind, f"expected {kind!r}, got {msg}"
        return msg

    def close_conn(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def close(self) -> None:
        self.close_conn()
        self.server.close()


class Launcher:
    """A launcher subprocess with its stdout/stderr captured to files."""

    def __init__(self, env: dict[str, str], run_dir: Path, out_dir: Path, *args: str) -> None:
        self.run_dir = run_dir
        self.out_path = out_dir / "launcher.out"
        self.err_path = out_dir / "launcher.err"
        self.termination_log = Path(env[contract.ENV_TERMINATION_LOG])
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kelastic.launch", "--run-dir", str(run_dir), *args],
                env=env,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait(self, timeout: float = 30.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"launcher still running after {timeout}s; stderr:\n{self.stderr()}"
            ) from None


def _gone(pid: int) -> bool:
    """True if ``pid`` no longer runs (dead, or a zombie that init has not reaped yet)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def marker_procs(marker: str) -> list[int]:
    """Live processes carrying this test's marker in their environment."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARKER) == marker and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def torch_env(rank: int, local_rank: int, world: int = 4, group_rank: int = 1) -> dict[str, str]:
    """The env a supervisor assigns: every torch elastic name but the two file paths."""
    return {
        contract.RANK: str(rank),
        contract.LOCAL_RANK: str(local_rank),
        contract.WORLD_SIZE: str(world),
        contract.LOCAL_WORLD_SIZE: "2",
        contract.GROUP_RANK: str(group_rank),
        contract.GROUP_WORLD_SIZE: "2",
        contract.ROLE_RANK: str(rank),
        contract.ROLE_WORLD_SIZE: str(world),
        contract.ROLE_NAME: contract.DEFAULT_ROLE,
        contract.MASTER_ADDR: "10.0.0.7",
        contract.MASTER_PORT: "29511",
        contract.TORCHELASTIC_RUN_ID: "job-uid-1",
        contract.TORCHELASTIC_RESTART_COUNT: "0",
        contract.TORCHELASTIC_MAX_RESTARTS: "3",
    }


def assign(attempt: int, nproc: int = 2, modes: dict[int, str] | None = None) -> dict[str, Any]:
    workers = []
    for lr in range(nproc):
        env = torch_env(rank=2 + lr, local_rank=lr)
        env[f"KL_MODE_{lr}"] = (modes or {}).get(lr, "ok")
        workers.append({"local_rank": lr, "env": env})
    return {"type": "assign", "attempt": attempt, "round": 5, "workers": workers}


def log_file(run_dir: Path, attempt: int, local_rank: int, name: str) -> Path:
    return contract.worker_log_dir(attempt, local_rank, run_dir) / name


def contains(path: Path, text: str) -> bool:
    return path.exists() and text in path.read_text(errors="replace")


def wait_ready(run_dir: Path, attempt: int, local_ranks: list[int]) -> None:
    for lr in local_ranks:
        path = log_file(run_dir, attempt, lr, contract.STDOUT_LOG_NAME)
        wait_for(partial(contains, path, "ready"), timeout=30, what=f"local_rank {lr} ready")


#: Launcher options of the "warm" worlds: a zygote that preloads two cheap stdlib modules
#: (the torch preload is exercised in tests/worker_lib/test_warm_start.py).
WARM_ARGS = ("--warm-start", "--preload", "json,decimal")


class Env:
    """Per-test world: short run dir (socket paths are limited to 108 bytes), marker.

    A ``warm`` world starts every launcher with :data:`WARM_ARGS`: each test using
    the ``world`` fixture runs both ways, so warm workers must behave exactly like cold
    ones (env, logs, exits, error files, stops, signals, no strays).
    """

    def __init__(self, base: Path, tmp_path: Path, warm: bool = False) -> None:
        self.warm = warm
        self.run_dir = base / "run"
        self.run_dir.mkdir()
        self.out_dir = tmp_path
        self.marker = uuid.uuid4().hex
        self.worker = tmp_path / "worker.py"
        self.worker.write_text(WORKER)
        self.env = dict(os.environ)
        self.env.update(
            {
                MARKER: self.marker,
                "KL_OUT_DIR": str(tmp_path),
                contract.ENV_TERMINATION_LOG: str(tmp_path / "termination-log"),
            }
        )
        self.env.pop("PYTHONUNBUFFERED", None)  # workers' stdout is block-buffered
        for name in contract.WORKER_ENV_NAMES:
            self.env.pop(name, None)
        self.launchers: list[Launcher] = []
        self.supervisor: Supervisor | None = None

    def serve(self) -> Supervisor:
        self.supervisor = Supervisor(self.run_dir)
        return self.supervisor

    def launch(self, *args: str, nproc: int = 2, cmd: list[str] | None = None) -> Launcher:
        warm = WARM_ARGS if self.warm else ()
        argv = ["--nproc-per-node", str(nproc), "--stop-grace", "1", *warm, *args, "--"]
        argv += cmd or [sys.executable, str(self.worker)]
        launcher = Launcher(self.env, self.run_dir, self.out_dir, *argv)
        self.launchers.append(launcher)
        return launcher

    def start(self, nproc: int = 2) -> tuple[Supervisor, Launcher]:
        """Serve, launch, accept and check ``hello``."""
        sup = self.serve()
        launcher = self.launch(nproc=nproc)
        sup.accept()
        hello = sup.expect("hello")
        assert hello == {"type": "hello", "pid": launcher.pid, "nproc": nproc, "netcheck": True}
        return sup, launcher

    def cleanup(self) -> None:
        for launcher in self.launchers:
            if launcher.proc.poll() is None:
                launcher.proc.kill()
                launcher.proc.wait()
        for pid in marker_procs(self.marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.supervisor is not None:
            self.supervisor.close()


@pytest.fixture(params=["cold", "warm"])
def world(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Env]:
    base = Path(tempfile.mkdtemp(prefix="kl-", dir="/tmp"))
    env = Env(base, tmp_path, warm=request.param == "warm")
    try:
        yield env
    finally:
        env.cleanup()
        shutil.rmtree(base, ignore_errors=True)


def expect_exits(sup: Supervisor, n: int, timeout: float = 30.0) -> dict[int, dict[str, Any]]:
    exits = {}
    for _ in range(n):
        msg = sup.expect("exited", timeout)
        exits[msg["local_rank"]] = msg
    return exits


# --------------------------------------------------------------------------- tests
def test_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kelastic.launch", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    for flag in ("--nproc-per-node", "--run-dir", "--stop-grace", "--connect-timeout", "-- cmd"):
        assert flag in out


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["python", "x.py"], "missing '--'"),
        (["--"], "no worker command"),
        (["--stop-grace", "-1", "--", "true"], "--stop-grace"),
    ],
)
def test_usage_errors(argv: list[str], error: str) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "kelastic.launch", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2
    assert error in res.stderr
    assert "Traceback" not in res.stderr


def test_connect_timeout(world: Env) -> None:
    launcher = world.launch("--connect-timeout", "0.5")
    start = time.monotonic()
    assert launcher.wait() == 1
    assert time.monotonic() - start < 20
    err = launcher.stderr()
    assert "did not accept a connection within 0.5s" in err
    assert "Traceback" not in err
    assert "did not accept a connection" in launcher.termination_log.read_text()


def test_happy_path_two_workers(world: Env) -> None:
    sup, launcher = world.start()
    sup.send(assign(attempt=0))
    started = sup.expect("started")
    assert started["attempt"] == 0
    assert set(started["pids"]) == {"0", "1"}
    exits = expect_exits(sup, 2)
    for lr in (0, 1):
        msg = exits[lr]
        assert msg["pid"] == started["pids"][str(lr)]
        assert msg["attempt"] == 0
        assert (msg["exitcode"], msg["signal"], msg["error"]) == (0, None, None)
        assert msg["tail"] == [f"err line from rank {2 + lr}", f"partial from rank {2 + lr}"]

    for lr in (0, 1):
        env = json.loads((world.out_dir / f"env_{lr}.json").read_text())
        expected = torch_env(rank=2 + lr, local_rank=lr)
        assert {k: env[k] for k in expected} == expected
        log_dir = contract.worker_log_dir(0, lr, world.run_dir)
        assert env[contract.TORCHELASTIC_ERROR_FILE] == str(log_dir / "error.json")
        assert env[contract.TORCHELASTIC_TIMER_FILE] == str(contract.timer_fifo_path(world.run_dir))
        assert env[contract.KELASTIC_ROUND] == "5"
        assert env[MARKER] == world.marker  # the launcher's own env passes through
        assert set(contract.WORKER_ENV_NAMES) <= set(env)
        out = (log_dir / contract.STDOUT_LOG_NAME).read_text()
        err = (log_dir / contract.STDERR_LOG_NAME).read_text()
        assert out == f"out line from rank {2 + lr}\n"
        assert err == f"err line from rank {2 + lr}\npartial from rank {2 + lr}"
        assert not (log_dir / contract.ERROR_FILE_NAME).exists()

    sup.send({"type": "shutdown", "exitcode": 0, "summary": "job succeeded"})
    assert launcher.wait() == 0
    assert launcher.termination_log.read_text() == "job succeeded"
    stdout, stderr = launcher.stdout(), launcher.stderr()
    assert stderr.count(") pid ") == 2
    assert stderr.count(" (warm)") == (2 if world.warm else 0)
    for rank in (2, 3):
        assert f"[{rank}]: out line from rank {rank}\n" in stdout
        assert f"[{rank}]: err line from rank {rank}\n" in stderr
        assert f"[{rank}]: partial from rank {rank}\n" in stderr
    assert marker_procs(world.marker) == []


def test_worker_failure_reports_error_file_and_tail(world: Env) -> None:
    sup, launcher = world.start()
    sup.send(assign(attempt=3, modes={1: "fail"}))
    started = sup.expect("started")
    exits = expect_exits(sup, 2)
    assert exits[0]["exitcode"] == 0
    failed = exits[1]
    assert failed["pid"] == started["pids"]["1"]
    assert (failed["exitcode"], failed["signal"]) == (1, None)
    error = failed["error"]
    assert error["message"] == "ValueError: boom from rank 3"
    assert "Traceback (most recent call last)" in error["traceback"]
    assert 'raise ValueError(f"boom from rank {rank}")' in error["traceback"]
    assert abs(error["timestamp"] - time.time()) < 120
    assert len(failed["tail"]) == 20
    assert failed["tail"][-1] == "ValueError: boom from rank 3"
    on_disk = json.loads(log_file(world.run_dir, 3, 1, contract.ERROR_FILE_NAME).read_text())
    assert on_disk["message"]["message"] == "ValueError: boom from rank 3"

    sup.send({"type": "shutdown", "exitcode": 1, "summary": ""})
    assert launcher.wait() == 1
    summary = launcher.termination_log.read_text()
    assert "rank 3 (local_rank 1" in summary
    assert "exited with code 1" in summary
    assert "ValueError: boom from rank 3" in summary


def test_error_file_written_by_torch_record_is_reported(world: Env) -> None:
    sup, launcher = world.start(nproc=1)
    sup.send(assign(attempt=0, nproc=1, modes={0: "torch_fail"}))
    sup.expect("started")
    msg = sup.expect("exited", timeout=120)
    assert (msg["exitcode"], msg["signal"]) == (1, None)
    assert msg["error"]["message"] == "RuntimeError: torch boom from rank 2"
    assert 'raise RuntimeError(f"torch boom from rank {rank}")' in msg["error"]["traceback"]
    assert isinstance(msg["error"]["timestamp"], int)
    sup.send({"type": "shutdown", "exitcode": 1, "summary": ""})
    assert launcher.wait() == 1


def test_worker_killed_by_signal_then_stop(world: Env) -> None:
    sup, launcher = world.start()
    sup.send(assign(attempt=0, modes={0: "sleep", 1: "sleep"}))
    pids = sup.expect("started")["pids"]
    wait_ready(world.run_dir, 0, [0, 1])
    os.kill(pids["1"], signal.SIGKILL)
    msg = sup.expect("exited")
    assert (msg["local_rank"], msg["pid"]) == (1, pids["1"])
    assert (msg["exitcode"], msg["signal"], msg["error"]) == (None, signal.SIGKILL, None)

    sup.send({"type": "stop", "attempt": 0, "reason": "peer failed"})
    assert sup.expect("stopped") == {"type": "stopped", "attempt": 0}  # no "exited" for rank 0
    assert _gone(pids["0"])
    sup.send({"type": "shutdown", "exitcode": 0, "summary": ""})
    assert sup.recv() is None  # closed, nothing else sent
    assert launcher.wait() == 0


def test_stop_escalates_to_sigkill_then_second_attempt(world: Env) -> None:
    sup, launcher = world.start()
    sup.send(assign(attempt=1, modes={0: "sleep", 1: "ignore_term"}))
    pids = sup.expect("started")["pids"]
    wait_ready(world.run_dir, 1, [0, 1])

    start = time.monotonic()
    sup.send({"type": "stop", "attempt": 1, "reason": "rescale"})
    assert sup.expect("stopped") == {"type": "stopped", "attempt": 1}
    elapsed = time.monotonic() - start
    assert 0.9 <= elapsed < 8, elapsed  # --stop-grace 1, then SIGKILL
    assert all(_gone(pid) for pid in pids.values())
    for lr in (0, 1):
        err = log_file(world.run_dir, 1, lr, contract.STDERR_LOG_NAME).read_text()
        assert "got SIGTERM" in err
    # A stale stop for an attempt that is not running is answered at once.
    sup.send({"type": "stop", "attempt": 0, "reason": "stale"})
    assert sup.expect("stopped") == {"type": "stopped", "attempt": 0}

    sup.send(assign(attempt=2))
    started = sup.expect("started")
    assert started["attempt"] == 2
    exits = expect_exits(sup, 2)
    assert {lr: m["exitcode"] for lr, m in exits.items()} == {0: 0, 1: 0}
    assert all(m["attempt"] == 2 for m in exits.values())
    assert log_file(world.run_dir, 2, 1, contract.STDOUT_LOG_NAME).read_text() == (
        "out line from rank 3\n"
    )
    sup.send({"type": "shutdown", "exitcode": 0, "summary": "done"})
    assert launcher.wait() == 0
    assert marker_procs(world.marker) == []
    # The zygote outlives the stop of attempt 1 and forks attempt 2's workers too.
    assert launcher.stderr().count(" (warm)") == (4 if world.warm else 0)


def test_shutdown_while_running_stops_workers_and_truncates_summary(world: Env) -> None:
    sup, launcher = world.start()
    sup.send(assign(attempt=0, modes={0: "sleep", 1: "sleep"}))
    pids = sup.expect("started")["pids"]
    wait_ready(world.run_dir, 0, [0, 1])
    summary = "é" * 3000  # 6000 bytes of two-byte characters
    sup.send({"type": "shutdown", "exitcode": 7, "summary": summary})
    assert launcher.wait() == 7
    data = launcher.termination_log.read_bytes()
    assert len(data) == contract.TERMINATION_MESSAGE_MAX_BYTES
    assert data.decode("utf-8") == "é" * 2048
    assert all(_gone(pid) for pid in pids.values())
    assert marker_procs(world.marker) == []


def test_sidecar_gone_stops_workers_and_exits_1(world: Env) -> None:
    sup, launcher = world.start()
    sup.send(assign(attempt=0, modes={0: "sleep", 1: "ignore_term"}))
    pids = sup.expect("started")["pids"]
    wait_ready(world.run_dir, 0, [0, 1])
    sup.close_conn()
    assert launcher.wait() == 1
    assert all(_gone(pid) for pid in pids.values())
    assert marker_procs(world.marker) == []
    assert "closed the control connection" in launcher.termination_log.read_text()
    assert "Traceback" not in launcher.stderr()


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (b"{not json\n", "not JSON"),
        (b'["assign"]\n', "not a JSON object"),
        (b'{"type": "assign", "round": 1, "workers": []}\n', "integer 'attempt'"),
        (b'{"type": "stop", "attempt": "one"}\n', "integer 'attempt'"),
        (b'{"type": "x", "pad": "' + b"a" * contract.CONTROL_MAX_LINE + b'"}\n', "limit"),
        (b'{"type": "respawn", "attempt": 0, "local_rank": 4096, "env": {}}\n', "above 4095"),
        (
            b'{"type": "respawn", "attempt": 0, "local_rank": 1, "env": {"A=B": "1"}}\n',
            "invalid name",
        ),
    ],
    ids=[
        "not-json",
        "not-object",
        "assign-no-attempt",
        "stop-bad-attempt",
        "too-long",
        "respawn-rank-too-big",
        "respawn-bad-env",
    ],
)
def test_malformed_message_exits_1(world: Env, line: bytes, reason: str) -> None:
    sup, launcher = world.start()
    sup.send(assign(attempt=0, modes={0: "sleep", 1: "sleep"}))
    pids = sup.expect("started")["pids"]
    # The launcher may hang up before it read all of a huge line.
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        sup.send_raw(line)
    assert launcher.wait() == 1
    err = launcher.stderr()
    assert "malformed control message" in err
    assert reason in err
    assert "Traceback" not in err
    assert reason in launcher.termination_log.read_text()
    assert all(_gone(pid) for pid in pids.values())


def test_unknown_message_type_is_ignored(world: Env) -> None:
    sup, launcher = world.start()
    sup.send({"type": "warm_start_hint", "attempt": 0})
    sup.send({"type": "stop", "attempt": 4, "reason": ""})
    assert sup.expect("stopped") == {"type": "stopped", "attempt": 4}
    assert "unknown type 'warm_start_hint'" in launcher.stderr()
    sup.send({"type": "shutdown", "exitcode": 0, "summary": ""})
    assert launcher.wait() == 0


def test_spawn_failure_is_reported_as_exit_127(world: Env) -> None:
    sup = world.serve()
    launcher = world.launch(nproc=1, cmd=["/nonexistent/kelastic-test-binary"])
    sup.accept()
    sup.expect("hello")
    sup.send(assign(attempt=0, nproc=1))
    assert sup.expect("started")["pids"] == {}
    msg = sup.expect("exited")
    assert (msg["local_rank"], msg["pid"], msg["exitcode"], msg["signal"]) == (0, None, 127, None)
    assert "FileNotFoundError" in msg["error"]["message"]
    sup.send({"type": "shutdown", "exitcode": 1, "summary": "x"})
    assert launcher.wait() == 1


def test_sigterm_to_launcher_leaves_no_process(world: Env) -> None:
    sup, launcher = world.start()
    sup.send(assign(attempt=0, modes={0: "spawn", 1: "escape"}))
    pids = sup.expect("started")["pids"]
    escaped = sup.expect("exited")  # rank 1 returns after starting a setsid grandchild
    assert (escaped["local_rank"], escaped["exitcode"]) == (1, 0)
    wait_ready(world.run_dir, 0, [0])
    grandchildren = [
        int(log_file(world.run_dir, 0, lr, contract.STDOUT_LOG_NAME).read_text().split()[1])
        for lr in (0, 1)
    ]
    # The orphaned grandchild was reparented to the launcher (child subreaper).
    wait_for(
        lambda: psutil.Process(grandchildren[1]).ppid() == launcher.pid,
        timeout=10,
        what="orphan reparented to the launcher",
    )
    descendants = [p.pid for p in psutil.Process(launcher.pid).children(recursive=True)]
    assert {pids["0"], *grandchildren} <= set(descendants)

    os.kill(launcher.pid, signal.SIGTERM)
    assert launcher.wait() == 128 + signal.SIGTERM
    assert [pid for pid in descendants if not _gone(pid)] == []
    assert marker_procs(world.marker) == []
    assert "received SIGTERM" in launcher.termination_log.read_text()
    assert sup.recv() is None  # the launcher hung up without reporting stop-caused exits


def test_sigkill_of_launcher_kills_workers(world: Env) -> None:
    sup, launcher = world.start()
    sup.send(assign(attempt=0, modes={0: "sleep", 1: "ignore_term"}))
    pids = sup.expect("started")["pids"]
    wait_ready(world.run_dir, 0, [0, 1])
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    wait_for(
        lambda: all(_gone(pid) for pid in pids.values()),
        timeout=10,
        what="workers killed by PR_SET_PDEATHSIG",
    )
    wait_for(lambda: not marker_procs(world.marker), timeout=10, what="no marker process")


def test_second_sigint_skips_the_grace_period(world: Env) -> None:
    sup = world.serve()
    launcher = world.launch("--stop-grace", "60")  # the last --stop-grace wins
    sup.accept()
    sup.expect("hello")
    sup.send(assign(attempt=0, modes={0: "ignore_term", 1: "ignore_term"}))
    pids = sup.expect("started")["pids"]
    wait_ready(world.run_dir, 0, [0, 1])
    start = time.monotonic()
    os.kill(launcher.pid, signal.SIGINT)
    for lr in (0, 1):  # the workers got SIGTERM and ignore it
        path = log_file(world.run_dir, 0, lr, contract.STDERR_LOG_NAME)
        wait_for(partial(contains, path, "got SIGTERM"), timeout=10, what="SIGTERM")
    os.kill(launcher.pid, signal.SIGINT)
    assert launcher.wait() == 128 + signal.SIGINT
    assert time.monotonic() - start < 20
    assert "received SIGINT again" in launcher.stderr()
    assert all(_gone(pid) for pid in pids.values())
    assert marker_procs(world.marker) == []


def test_respawn_starts_only_the_dead_worker_again(world: Env) -> None:
    # The hybrid rung of in-process restart: the peers keep running, only the dead local
    # rank becomes a process again, in the same attempt, with the sidecar's env on top.
    sup, launcher = world.start()
    sup.send(assign(attempt=2, modes={0: "sleep", 1: "sleep"}))
    pids = sup.expect("started")["pids"]
    wait_ready(world.run_dir, 2, [0, 1])
    os.kill(pids["1"], signal.SIGKILL)
    msg = sup.expect("exited")
    assert (msg["local_rank"], msg["signal"]) == (1, signal.SIGKILL)
    env = {contract.KELASTIC_ROUND: "5", "KL_MODE_1": "ok", "KELASTIC_INPROCESS_ITERATION": "3"}
    sup.send({"type": "respawn", "attempt": 2, "local_rank": 1, "env": env})
    again = sup.expect("started")
    assert again["attempt"] == 2 and set(again["pids"]) == {"1"}
    assert again["pids"]["1"] != pids["1"] and again["warm"] == (1 if world.warm else 0)
    done = sup.expect("exited")
    assert (done["local_rank"], done["pid"], done["exitcode"]) == (1, again["pids"]["1"], 0)
    seen = json.loads((world.out_dir / "env_1.json").read_text())
    assert seen["KELASTIC_INPROCESS_ITERATION"] == "3"
    assert seen[contract.RANK] == "3" and seen[contract.LOCAL_RANK] == "1"
    assert psutil.pid_exists(pids["0"]) and not _gone(pids["0"])  # the peer never stopped
    # the respawned worker's output appends to the same log: nothing of the dead one lost
    assert contains(log_file(world.run_dir, 2, 1, contract.STDOUT_LOG_NAME), "ready\nout line")
    # a respawn for a worker that runs, or for another attempt, is ignored
    sup.send({"type": "respawn", "attempt": 2, "local_rank": 0, "env": {}})
    sup.send({"type": "respawn", "attempt": 9, "local_rank": 1, "env": {}})
    sup.send({"type": "stop", "attempt": 2, "reason": "done"})
    assert sup.expect("stopped") == {"type": "stopped", "attempt": 2}
    sup.send({"type": "shutdown", "exitcode": 0, "summary": ""})
    assert launcher.wait() == 0
    assert marker_procs(world.marker) == []
