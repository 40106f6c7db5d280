"""The embedded etcd's temporary data: a process SIGKILLed before it stopped its etcd
leaves the data directory, and the next EmbeddedEtcd removes it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from kelastic_operator.local.etcd import DATA_DIR_PREFIX, EmbeddedEtcd, sweep_dead_data_dirs
from tests.conftest import wait_for

OWNER = """
import sys
from kelastic_operator.local.etcd import EmbeddedEtcd
etcd = EmbeddedEtcd(die_with_parent=True).start()
print(etcd.data_dir, etcd.proc.pid, flush=True)
sys.stdin.read()
"""


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_the_data_of_a_sigkilled_owner_goes_with_the_next_etcd() -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert owner.stdout is not None
    data_dir, etcd_pid = owner.stdout.readline().split()
    left = Path(data_dir)
    assert left.name.startswith(f"{DATA_DIR_PREFIX}{owner.pid}-")
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    # the etcd dies with its owner; its data stays (no teardown ran)
    wait_for(lambda: _gone(int(etcd_pid)), 10, what="the owner's etcd to die with it")
    assert (left / "data" / "member").is_dir()
    ours = EmbeddedEtcd()
    try:
        assert not left.exists()
        assert ours.data_dir.name.startswith(f"{DATA_DIR_PREFIX}{os.getpid()}-")
        assert ours.data_dir.is_dir()
    finally:
        ours.stop()
    assert not ours.data_dir.exists()


def test_only_the_data_of_dead_owners_is_swept(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    doomed = tmp_path / f"{DATA_DIR_PREFIX}{dead.pid}-abc"
    kept = [
        tmp_path / f"{DATA_DIR_PREFIX}{os.getpid()}-abc",  # a live owner (this process)
        tmp_path / f"{DATA_DIR_PREFIX}{os.getppid()}-x_y",  # another live one
        tmp_path / f"{DATA_DIR_PREFIX}1x9cezny",  # the old naming: no owner known
        tmp_path / f"{DATA_DIR_PREFIX}99999999999-abc",  # beyond any pid
        tmp_path / f"{DATA_DIR_PREFIX}-abc",
        tmp_path / "other-etcd-1-abc",
    ]
    for path in (doomed, *kept):
        (path / "data").mkdir(parents=True)
    as_file = tmp_path / f"{DATA_DIR_PREFIX}{dead.pid}-file"
    as_file.write_text("not ours to remove")
    link = tmp_path / f"{DATA_DIR_PREFIX}{dead.pid}-link"
    link.symlink_to(kept[0])
    assert sweep_dead_data_dirs(tmp_path) == [doomed]
    assert all((p / "data").is_dir() for p in kept)
    assert as_file.read_text() == "not ours to remove" and link.is_symlink()
