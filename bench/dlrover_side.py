"""DLRover 0.6.1's flash checkpoint as a side of ``python -m bench checkpoint``, run the
way its users run it: the trainer (:mod:`bench._dlrover_ckpt`) under ``dlrover-run``, whose
agent creates the ``AsyncCheckpointSaver`` that owns the shared memory, beside a DLRover
master (``python -m dlrover.python.master.main --platform local``, gRPC on loopback).

One run of the job measures, on the CPU state of :func:`bench.checkpoint.state_dict`:

- ``save_stall_s``: the median seconds the trainer is blocked in ``DdpCheckpointer.
  save_checkpoint(step, state, storage_type=StorageType.MEMORY)`` over ``repeats`` saves
  (``save_first_s``: the first, which creates the shared memory, apart);
- ``load_s``: the trainer fails after its saves, the agent restarts it (``--max-restarts=1``)
  and the new process's ``load_checkpoint()`` returns the state from the agent's shared
  memory (tensors that view it: no byte is read yet); ``restore_s`` adds the copy of those
  tensors into the trainer's own (what ``load_state_dict`` does; the shared pages are first
  touched there), then checked (crc32) against the state saved;
- ``persist_s``: a ``StorageType.DISK`` save (``disk_save_stall_s`` until it returns) until
  the agent's saver has written DLRover's tracker file with the step (its ``torch.save``
  of the state from the shared memory to the file, not fsync-ed, then a done file and the
  tracker, fsync-ed); polled every 10 ms.

Why the master is started here and not by ``dlrover-run --standalone``: 0.6.1 starts it
through torch's ``SubprocessHandler`` without the ``numa_options`` argument that torch
2.13 requires (``TypeError``); the same master on a free loopback port, named to
``dlrover-run`` by ``DLROVER_MASTER_ADDR``, is what ``--standalone`` would start.

Install: ``python3 -m venv --system-site-packages /tmp/dlrover-venv`` and
``/tmp/dlrover-venv/bin/pip install -c <file with torch==2.13.0> dlrover==0.6.1 grpcio``
(its master and client speak gRPC, which only its ``k8s`` extra declares; the interpreter
is ``$BENCH_DLROVER_PYTHON``, default ``/tmp/dlrover-venv/bin/python``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import psutil

from .common import REPO, child_env, median, spawn_logged

VERSION = "0.6.1"
DEFAULT_PYTHON = "/tmp/dlrover-venv/bin/python"
_INSTALL = (
    "python3 -m venv --system-site-packages /tmp/dlrover-venv && /tmp/dlrover-venv/bin/pip "
    f"install -c <(echo torch==2.13.0) dlrover=={VERSION} grpcio (or set BENCH_DLROVER_PYTHON)"
)


def _python(timeout: float, env: dict[str, str]) -> Path | str:
    """The interpreter with ``dlrover``, or why there is none."""
    python = Path(os.environ.get("BENCH_DLROVER_PYTHON", DEFAULT_PYTHON))
    if not python.exists():
        return f"DLRover: no interpreter at {python}; install: {_INSTALL}"
    code = "import dlrover.trainer.torch.flash_checkpoint.ddp, dlrover.python.master.main"
    try:
        probe = subprocess.run(
            [str(python), "-c", code], capture_output=True, timeout=timeout, env=env
        )
    except subprocess.TimeoutExpired:
        return f"DLRover: importing dlrover with {python} took over {timeout:.0f} s"
    if probe.returncode != 0:
        last = (probe.stderr.decode(errors="replace").strip().splitlines() or ["?"])[-1]
        return f"DLRover: dlrover not importable with {python} ({last}); install: {_INSTALL}"
    return python


def _wait_port(port: int, proc: subprocess.Popen[bytes], deadline: float) -> bool:
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return True
        time.sleep(0.2)
    return False


def _kill_tree(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILL each of ``procs``, its process group and every descendant (the trainers
    run in sessions of their own); reaps ``procs``."""
    victims: list[psutil.Process] = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            victims.extend(psutil.Process(proc.pid).children(recursive=True))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    for victim in victims:
        with contextlib.suppress(psutil.Error):
            victim.kill()
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
    psutil.wait_procs(victims, timeout=10)


def _tail(path: Path, lines: int = 3) -> str:
    if not path.exists():
        return ""
    text = path.read_text(errors="replace").strip().splitlines()
    return " | ".join(line.strip()[:200] for line in text[-lines:])


def measure_dlrover(
    total_bytes: int, repeats: int, workdir: Path, timeout: float
) -> dict[str, float] | str:
    """DLRover's seconds for a state of ``total_bytes`` (see the module's doc): a dict of
    ``save_stall_s``, ``save_first_s``, ``load_s``, ``restore_s``, ``disk_save_stall_s``,
    ``persist_s`` and ``wall_s`` (the whole run), or a one-line reason it was not measured.
    Everything it starts is killed after ``timeout`` seconds; its files go in ``workdir``."""
    started = time.monotonic()
    deadline = started + timeout
    job = f"kelastic-bench-{uuid.uuid4().hex[:8]}"
    workdir.mkdir(parents=True, exist_ok=True)
    out, ckpt_dir = workdir / "dlrover.jsonl", workdir / "dlrover-ckpt"
    out.unlink(missing_ok=True)
    from kelastic_operator.local.etcd import free_port

    port = free_port()
    env = child_env(
        DLROVER_MASTER_ADDR=f"127.0.0.1:{port}",
        ELASTIC_JOB_NAME=job,
        DLROVER_EVENT_FILE_DIR=str(workdir / "dlrover-events"),  # else /tmp/dlrover
    )
    env.pop("TORCHELASTIC_RUN_ID", None)
    python = _python(min(timeout, 120.0), env)
    if isinstance(python, str):
        return python
    master_args = [str(python), "-u", "-m", "dlrover.python.master.main", "--port", str(port),
                   "--node_num", "1", "--job_name", job, "--platform", "local"]  # fmt: skip
    run_args = [str(python), "-m", "dlrover.trainer.torch.main", "--nnodes=1",
                "--nproc-per-node=1", "--max-restarts=1", "--monitor-interval=0.1",
                f"--log-dir={workdir / 'elastic'}", str(REPO / "bench" / "_dlrover_ckpt.py"),
                str(out), str(total_bytes), str(repeats), str(ckpt_dir)]  # fmt: skip
    procs: list[subprocess.Popen[bytes]] = []
    try:
        master = spawn_logged(master_args, env, workdir / "dlrover-master.log", workdir)
        procs.append(master)
        if not _wait_port(port, master, min(deadline, time.monotonic() + 120)):
            why = _tail(workdir / "dlrover-master.log")
            return f"DLRover: its master did not listen on port {port}: {why}"
        agent = spawn_logged(run_args, env, workdir / "dlrover-run.log", workdir)
        procs.append(agent)
        try:
            code = agent.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            return f"DLRover: timed out after {timeout:.0f} s; {_tail(workdir / 'dlrover-run.log')}"
        wall = time.monotonic() - started
    finally:
        _kill_tree(procs)
        shutil.rmtree(Path("/tmp/ckpt_sock") / job, ignore_errors=True)
        Path(f"/dev/shm/{job}_ckpt_shm_0").unlink(missing_ok=True)
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    docs = {}
    for line in out.read_text().splitlines() if out.exists() else []:
        doc = json.loads(line)
        docs[doc["phase"]] = doc
    if "error" in docs:
        return f"DLRover: the trainer failed: {docs['error']['error']}"
    if code != 0 or "save" not in docs or "load" not in docs:
        return f"DLRover: dlrover-run exited {code}: {_tail(workdir / 'dlrover-run.log')}"
    save, load = docs["save"], docs["load"]
    return {
        "save_stall_s": median(save["save_s"]),
        "save_first_s": save["first_save_s"],
        "load_s": load["load_s"],
        "restore_s": load["load_s"] + load["copy_s"],
        "disk_save_stall_s": load["disk_save_stall_s"],
        "persist_s": load["persist_s"],
        "wall_s": wall,
    }
