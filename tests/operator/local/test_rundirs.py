"""Run dirs of ``kelastic run``: owner records and the cleaning of stale ones (real
processes; their pids and start times from /proc)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kelastic_operator.local.rundirs import (
    ETCD_DATA_DIR,
    OWNER_FILE,
    clean_stale,
    is_stale,
    mark_ended,
    process_start_time,
    write_owner,
)


def _run_dir(parent: Path, name: str, pid: int | None = None) -> Path:
    run_dir = parent / name
    (run_dir / ETCD_DATA_DIR / "member").mkdir(parents=True)
    (run_dir / ETCD_DATA_DIR / "member" / "wal").write_bytes(b"x" * 1000)
    (run_dir / "pods").mkdir()
    write_owner(run_dir, pid)
    return run_dir


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_only_dirs_whose_owner_is_gone_lose_their_etcd_data(tmp_path: Path) -> None:
    live = _run_dir(tmp_path, "live")  # this process
    dead = _run_dir(tmp_path, "dead", _dead_pid())
    reused = _run_dir(tmp_path, "reused")  # our pid, but recorded with another start time
    doc = json.loads((reused / OWNER_FILE).read_text())
    (reused / OWNER_FILE).write_text(json.dumps({**doc, "start_time": doc["start_time"] - 1}))
    ended = _run_dir(tmp_path, "ended", _dead_pid())
    mark_ended(ended)
    foreign = tmp_path / "foreign"
    (foreign / ETCD_DATA_DIR).mkdir(parents=True)  # no owner record: not ours
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / OWNER_FILE).write_text("{not json")

    assert not is_stale(live) and is_stale(dead) and is_stale(reused) and not is_stale(ended)
    cleaned = clean_stale(tmp_path)
    assert [c.run_dir.name for c in cleaned] == ["dead", "reused"]
    assert all(c.freed_bytes >= 1000 for c in cleaned)
    for run_dir in (dead, reused):
        assert not (run_dir / ETCD_DATA_DIR).exists() and (run_dir / "pods").is_dir()
        assert not is_stale(run_dir)  # marked ended: cleaned once
    for run_dir in (live, ended, foreign):
        assert (run_dir / ETCD_DATA_DIR).is_dir()
    assert clean_stale(tmp_path) == []


def test_process_start_time_is_that_of_the_live_process() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        started = process_start_time(proc.pid)
        assert started is not None and started == process_start_time(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert process_start_time(proc.pid) is None
