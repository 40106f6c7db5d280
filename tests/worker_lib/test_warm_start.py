"""Warm start (``python -m kelastic.launch --warm-start``): workers forked by a zygote.

Every launcher test of tests/worker_lib/test_launch.py also runs warm (its ``world`` fixture is
parametrized); this file covers what only warm start has: the worker a zygote makes
looks like a cold one to the program, the three command kinds, exit semantics, the
fallbacks to cold start, the zygote's handling of bad requests, and real torch DDP in
a worker forked from a zygote that preloaded torch.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from kelastic import contract
from kelastic._warm import PythonCommand, parse_python_command
from kelastic._zygote import recv_message, send_message
from tests.conftest import wait_for
from tests.worker_lib.test_launch import (
    MARKER,
    Env,
    _gone,
    assign,
    expect_exits,
    log_file,
    marker_procs,
    world,
)

__all__ = ["world"]  # the fixture, imported for pytest

PY = sys.executable


@pytest.fixture
def warm_world(tmp_path: Path) -> Iterator[Env]:
    """A world whose launchers all start with ``--warm-start`` (not parametrized)."""
    base = Path(tempfile.mkdtemp(prefix="kl-", dir="/tmp"))
    env = Env(base, tmp_path, warm=True)
    try:
        yield env
    finally:
        env.cleanup()
        shutil.rmtree(base, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# Prints what a program can see of how it was started, then exits with $KL_CODE.
PROBE = textwrap.dedent(
    r"""
    import atexit, json, os, sys, threading, time

    def later():
        time.sleep(0.2)
        print("non-daemon thread finished", flush=True)

    info = {
        "argv": sys.argv,
        "path0": sys.path[0],
        "name": __name__,
        "cwd": os.getcwd(),
        "stdin": os.readlink("/proc/self/fd/0"),
        "ppid": os.getppid(),
        "pgid": os.getpgid(0),
        "sid": os.getsid(0),
        "pid": os.getpid(),
        "preloaded": "decimal" in sys.modules,
        "rank": os.environ.get("RANK"),
        # what ps, psutil and other tools see
        "cmdline": open("/proc/self/cmdline", "rb").read().rstrip(b"\0").decode().split("\0"),
        "environ": dict(
            e.decode().split("=", 1)
            for e in open("/proc/self/environ", "rb").read().split(b"\0")
            if b"=" in e
        ),
    }
    print(json.dumps(info), flush=True)
    atexit.register(lambda: print("atexit ran", flush=True))
    threading.Thread(target=later).start()
    code = os.environ.get("KL_CODE", "0")
    sys.exit(int(code) if code.isdigit() else code)
    """
)


def _run_one(world: Env, cmd: list[str], *args: str, env: dict[str, str] | None = None) -> Any:
    """Launch ``cmd`` for one local rank; return (exited message, stdout log, launcher)."""
    sup = world.serve()
    launcher = world.launch(*args, nproc=1, cmd=cmd)
    sup.accept()
    sup.expect("hello")
    msg = assign(attempt=0, nproc=1)
    msg["workers"][0]["env"].update(env or {})
    sup.send(msg)
    sup.expect("started", timeout=60)
    exited = expect_exits(sup, 1)[0]
    sup.send({"type": "shutdown", "exitcode": 0, "summary": ""})
    assert launcher.wait() == 0
    out = log_file(world.run_dir, 0, 0, contract.STDOUT_LOG_NAME).read_text()
    return exited, out, launcher


# ---------------------------------------------------------------- command parsing
@pytest.mark.parametrize(
    ("cmd", "expected"),
    [
        (["python3", "train.py", "--lr", "1"], ("script", "train.py", ("--lr", "1"), False)),
        ([PY, "-u", "train.py"], ("script", "train.py", (), True)),
        ([PY, "-uB", "-m", "pkg.mod", "-x"], ("module", "pkg.mod", ("-x",), True)),
        ([PY, "-mpkg.mod", "a"], ("module", "pkg.mod", ("a",), False)),
        ([PY, "-c", "print(1)", "a", "b"], ("code", "print(1)", ("a", "b"), False)),
        ([PY, "train.py", "-m", "x"], ("script", "train.py", ("-m", "x"), False)),
    ],
)
def test_parse_python_command(cmd: list[str], expected: tuple[Any, ...]) -> None:
    got = parse_python_command(cmd)
    assert isinstance(got, PythonCommand)
    assert (got.kind, got.target, got.argv, got.unbuffered) == expected
    assert os.path.isabs(got.interpreter)
    assert got.dont_write_bytecode == ("-uB" in cmd)


@pytest.mark.parametrize(
    ("cmd", "reason"),
    [
        ([], "empty command"),
        (["/bin/sh", "-c", "true"], "not a Python interpreter"),
        (["no-such-program-kl"], "not an executable"),
        ([PY, "-X", "dev", "train.py"], "'-X' is not supported"),
        ([PY, "-W", "error", "train.py"], "is not supported"),
        ([PY, "--version"], "is not supported"),
        ([PY], "no script"),
        ([PY, "-", "a"], "no script"),
        ([PY, "-m"], "needs an argument"),
    ],
)
def test_parse_python_command_refuses(cmd: list[str], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse_python_command(cmd)


# ------------------------------------------------------------------- the worker
@pytest.mark.parametrize("kind", ["script", "module", "code"])
def test_warm_worker_looks_like_a_cold_one(world: Env, kind: str) -> None:
    (world.out_dir / "kl_probe_mod.py").write_text(PROBE)
    probe = world.out_dir / "probe.py"
    probe.write_text(PROBE)
    cmd = {
        "script": [PY, str(probe), "a", "b"],
        "module": [PY, "-m", "kl_probe_mod", "a", "b"],
        "code": [PY, "-c", PROBE, "a", "b"],
    }[kind]
    world.env["PYTHONPATH"] = str(world.out_dir)
    exited, out, launcher = _run_one(world, cmd)
    assert (exited["exitcode"], exited["signal"]) == (0, None)
    info = json.loads(out.splitlines()[0])
    argv0 = {"script": str(probe), "module": str(world.out_dir / "kl_probe_mod.py"), "code": "-c"}
    assert info["argv"] == [argv0[kind], "a", "b"]
    assert info["path0"] == {"script": str(world.out_dir), "module": os.getcwd(), "code": ""}[kind]
    assert info["name"] == "__main__"
    assert info["cwd"] == os.getcwd()
    assert info["stdin"] == "/dev/null"
    assert info["rank"] == "2"
    assert info["cmdline"] == cmd
    environ = info["environ"]
    assert (environ["RANK"], environ["LOCAL_RANK"], environ[MARKER]) == ("2", "0", world.marker)
    assert "KELASTIC_ZYGOTE_ENV_PAD" not in environ
    # Its own session and process group; the launcher is its parent (it reaps it).
    assert info["pgid"] == info["sid"] == info["pid"] == exited["pid"]
    assert info["ppid"] == launcher.pid
    # Normal interpreter exit: non-daemon threads joined, then atexit handlers.
    assert out.splitlines()[1:] == ["non-daemon thread finished", "atexit ran"]
    # The zygote had imported the preload modules; a cold worker imports them itself.
    assert info["preloaded"] is world.warm
    assert launcher.stderr().count(" (warm)") == (1 if world.warm else 0)


@pytest.mark.parametrize(
    ("code", "exitcode", "tail"),
    [("3", 3, None), ("stopped by the program", 1, "stopped by the program")],
)
def test_exit_status_and_system_exit_message(
    world: Env, code: str, exitcode: int, tail: str | None
) -> None:
    probe = world.out_dir / "probe.py"
    probe.write_text(PROBE)
    exited, _, _ = _run_one(world, [PY, str(probe)], env={"KL_CODE": code})
    assert (exited["exitcode"], exited["signal"]) == (exitcode, None)
    assert exited["tail"] == ([tail] if tail else [])


def test_uncaught_exception_exits_1_with_traceback(world: Env) -> None:
    exited, _, _ = _run_one(world, [PY, "-c", "import sys\nraise KeyError('nope')"])
    assert exited["exitcode"] == 1
    assert exited["tail"][0] == "Traceback (most recent call last):"
    assert exited["tail"][-1] == "KeyError: 'nope'"


FINALIZED = textwrap.dedent(
    r"""
    import os, sys

    class Held:
        def __del__(self):
            os.write(1, f"finalizing={sys.is_finalizing()}\n".encode())

    held = Held()
    """
)


def test_program_globals_live_until_the_interpreter_exits(world: Env) -> None:
    """As in ``python script.py``, what the program's globals hold is destroyed during
    interpreter finalisation (a gloo process group destroyed earlier can deadlock)."""
    script = world.out_dir / "held.py"
    script.write_text(FINALIZED)
    exited, out, _ = _run_one(world, [PY, str(script)])
    assert exited["exitcode"] == 0
    assert out == "finalizing=True\n"


# --------------------------------------------------------------------- fallbacks
def test_not_a_python_command_starts_cold(warm_world: Env) -> None:
    exited, out, launcher = _run_one(warm_world, ["/bin/sh", "-c", "echo hello from sh"])
    assert exited["exitcode"] == 0
    assert out == "hello from sh\n"
    err = launcher.stderr()
    assert "warm start is off for this command ('/bin/sh' is not a Python interpreter)" in err
    assert " (warm)" not in err


def test_failed_preload_starts_cold(warm_world: Env) -> None:
    probe = warm_world.out_dir / "probe.py"
    probe.write_text(PROBE)
    exited, out, launcher = _run_one(
        warm_world, [PY, str(probe)], "--preload", "json,kl_no_such_mod"
    )
    assert exited["exitcode"] == 0
    assert json.loads(out.splitlines()[0])["ppid"] == launcher.pid
    err = launcher.stderr()
    assert "could not preload: import kl_no_such_mod failed: ModuleNotFoundError" in err
    assert " (warm)" not in err


def test_a_preload_that_initialises_cuda_is_refused(warm_world: Env) -> None:
    # CUDA cannot be initialised on this CPU-only machine: the module stands in for one
    # that would, as torch reports it.
    (warm_world.out_dir / "kl_cuda_init.py").write_text(
        "import torch\ntorch.cuda.is_initialized = lambda: True\n"
    )
    warm_world.env["PYTHONPATH"] = str(warm_world.out_dir)
    probe = warm_world.out_dir / "probe.py"
    probe.write_text(PROBE)
    args = ("--preload", "kl_cuda_init")
    exited, _, launcher = _run_one(warm_world, [PY, str(probe)], *args)
    assert exited["exitcode"] == 0  # started cold
    err = launcher.stderr()
    assert "a preload module initialised CUDA" in err
    assert " (warm)" not in err


def test_zygote_death_between_attempts_falls_back_to_cold(warm_world: Env) -> None:
    sup, launcher = warm_world.start(nproc=1)
    sup.send(assign(attempt=0, nproc=1))
    sup.expect("started")
    assert expect_exits(sup, 1)[0]["exitcode"] == 0
    zygotes = [
        p
        for p in psutil.Process(launcher.pid).children()
        if "kelastic._zygote" in " ".join(p.cmdline())
    ]
    assert len(zygotes) == 1
    zygotes[0].kill()
    wait_for(
        lambda: "warm start is off from now on" in launcher.stderr(), timeout=10, what="warning"
    )
    assert f"the zygote (pid {zygotes[0].pid}) exited with returncode -9" in launcher.stderr()
    sup.send(assign(attempt=1, nproc=1))
    sup.expect("started")
    assert expect_exits(sup, 1)[0]["exitcode"] == 0
    sup.send({"type": "shutdown", "exitcode": 0, "summary": ""})
    assert launcher.wait() == 0
    assert launcher.stderr().count(" (warm)") == 1  # attempt 0 only
    assert marker_procs(warm_world.marker) == []


def _slow_module(world: Env) -> None:
    (world.out_dir / "kl_slow_import.py").write_text("import time\ntime.sleep(120)\n")
    world.env["PYTHONPATH"] = str(world.out_dir)


def test_workers_start_cold_when_the_preload_times_out(warm_world: Env) -> None:
    _slow_module(warm_world)
    probe = warm_world.out_dir / "probe.py"
    probe.write_text(PROBE)
    args = ("--preload", "kl_slow_import", "--warm-start-timeout", "0.5")
    exited, _, launcher = _run_one(warm_world, [PY, str(probe)], *args)
    assert exited["exitcode"] == 0
    assert "the zygote was not ready within 0.5s" in launcher.stderr()
    assert " (warm)" not in launcher.stderr()
    assert marker_procs(warm_world.marker) == []


def test_sigterm_while_waiting_for_the_zygote(warm_world: Env) -> None:
    _slow_module(warm_world)
    sup = warm_world.serve()
    launcher = warm_world.launch("--preload", "kl_slow_import", nproc=1)
    sup.accept()
    sup.expect("hello")
    sup.send(assign(attempt=0, nproc=1))
    wait_for(lambda: "waiting for the warm-start zygote" in launcher.stderr(), what="waiting")
    os.kill(launcher.pid, signal.SIGTERM)
    assert launcher.wait(timeout=20) == 128 + signal.SIGTERM
    assert sup.recv() is None  # no worker was started
    wait_for(lambda: not marker_procs(warm_world.marker), timeout=10, what="zygote gone")


# ------------------------------------------------------------- the zygote itself
def test_zygote_answers_bad_requests_and_keeps_serving(tmp_path: Path) -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = subprocess.Popen(
        [PY, "-c", "from kelastic._zygote import main; main()", str(theirs.fileno()), "json"],
        pass_fds=(theirs.fileno(),),
        stderr=subprocess.PIPE,
    )
    theirs.close()
    ours.settimeout(30)
    try:
        got = recv_message(ours)
        assert got is not None
        assert got[0]["type"] == "ready"
        assert got[0]["preloaded"] == ["json"]

        def answer() -> str:
            reply = recv_message(ours)
            assert reply is not None
            assert reply[0]["type"] == "error"
            return str(reply[0]["error"])

        ours.send(b"{not json")
        assert answer().startswith("bad request:")
        ours.send(b"[1, 2]")
        assert answer() == "bad request: expected a JSON object, got list"
        send_message(ours, {"type": "dance"})
        assert answer() == "unknown request 'dance'"
        # A malformed spawn: the fds it carried are closed (the pipe sees EOF).
        r, w = os.pipe()
        send_message(ours, {"type": "spawn", "kind": "script", "target": 5}, (w, w))
        os.close(w)
        assert answer() == "malformed spawn request"
        assert os.read(r, 1) == b""
        os.close(r)
        assert proc.poll() is None
        ours.close()  # end of file: the zygote exits 0
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()


# ------------------------------------------------------------------------ torch
TORCH_WORKER = textwrap.dedent(
    r"""
    import os, sys, time
    preloaded = {m: m in sys.modules for m in ("torch", "torch._dynamo")}
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    model = DDP(torch.nn.Linear(4, 2))
    model(torch.randn(8, 4)).sum().backward()
    dist.all_reduce(t := torch.ones(1))
    print(preloaded, int(t.item()), flush=True)
    dist.destroy_process_group()
    """
)


def test_ddp_in_workers_forked_from_a_torch_zygote(warm_world: Env) -> None:
    """Two gloo DDP ranks forked by a zygote that imported torch and torch._dynamo."""
    world = warm_world
    script = world.out_dir / "ddp.py"
    script.write_text(TORCH_WORKER)
    world.env["OMP_NUM_THREADS"] = "1"
    sup = world.serve()
    launcher = world.launch(
        "--preload", "torch,torch.distributed,torch._dynamo", nproc=2, cmd=[PY, str(script)]
    )
    sup.accept()
    sup.expect("hello")
    msg = assign(attempt=0, nproc=2)
    port = _free_port()
    for lr, worker in enumerate(msg["workers"]):
        worker["env"].update(
            {
                "RANK": str(lr),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
        )
    sup.send(msg)
    sup.expect("started", timeout=120)
    try:
        exits = expect_exits(sup, 2, timeout=120)
    except AssertionError as e:
        logs = [log_file(world.run_dir, 0, lr, contract.STDERR_LOG_NAME) for lr in (0, 1)]
        text = "\n".join(p.read_text() for p in logs if p.exists())
        detail = f"worker stderr:\n{text}\nlauncher:\n{launcher.stderr()}"
        raise AssertionError(f"{e}\n{detail}") from None
    assert {lr: m["exitcode"] for lr, m in exits.items()} == {0: 0, 1: 0}, exits
    for lr in (0, 1):
        out = log_file(world.run_dir, 0, lr, contract.STDOUT_LOG_NAME).read_text()
        assert out == "{'torch': True, 'torch._dynamo': True} 2\n"
    sup.send({"type": "shutdown", "exitcode": 0, "summary": ""})
    assert launcher.wait() == 0
    assert launcher.stderr().count(" (warm)") == 2
    assert all(_gone(m["pid"]) for m in exits.values())


def test_a_zygote_whose_launcher_left_during_its_preload_exits_quietly() -> None:
    """The launcher gave up (its connect timeout) and closed the socket while the zygote
    was importing torch: the zygote's report finds no peer and it ends, printing no
    traceback (the launcher's close also kills it first now)."""
    from kelastic._zygote import serve

    ours, theirs = socket.socketpair()
    theirs.close()
    try:
        assert serve(ours, []) is None
    finally:
        ours.close()
