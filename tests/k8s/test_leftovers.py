"""What a killed test run leaves on disk is removed by the next one (``leftovers.py``), and
a killed image build's partial files by the next build (``images.sweep_unfinished``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from . import images
from .leftovers import run_is_dead, sweep_dead_runs


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _run(root: Path, name: str, lock: str | None) -> Path:
    """A base folder as pytest leaves it: a node's containerd root, an etcd member, a log."""
    base = root / name
    (base / "node0" / "containerd" / "root" / "snap").mkdir(parents=True)
    (base / "node0" / "containerd" / "root" / "snap" / "layer").write_bytes(b"x" * 4096)
    (base / "node0" / "kubelet.log").write_text("log\n")
    (base / "test_a0" / "data" / "member" / "wal").mkdir(parents=True)
    (base / "k8s-cluster0" / "etcd" / "data" / "member").mkdir(parents=True)
    if lock is not None:
        (base / ".lock").write_text(lock)
    return base


def test_a_dead_runs_nodes_and_etcd_data_go_and_its_logs_stay(tmp_path: Path) -> None:
    current = _run(tmp_path, "pytest-9", str(os.getpid()))
    dead = _run(tmp_path, "pytest-7", str(_dead_pid()))
    removed = sweep_dead_runs(current)
    assert sorted(removed) == sorted([
        dead / "node0" / "containerd",
        dead / "test_a0" / "data" / "member",
        dead / "k8s-cluster0" / "etcd" / "data" / "member",
    ])  # fmt: skip
    assert not (dead / "node0" / "containerd").exists()
    assert not (dead / "test_a0" / "data" / "member").exists()
    assert (dead / "node0" / "kubelet.log").read_text() == "log\n"
    assert (current / "node0" / "containerd" / "root" / "snap" / "layer").is_file()


@pytest.mark.parametrize(
    "lock",
    [None, "", "not a pid", "99999999999999999999999999", "-1", "\x00\xff"],
    ids=["no-lock", "empty", "text", "huge", "negative", "binary"],
)
def test_a_run_that_is_not_known_dead_is_left_alone(tmp_path: Path, lock: str | None) -> None:
    current = _run(tmp_path, "pytest-9", str(os.getpid()))
    other = _run(tmp_path, "pytest-8", lock)
    assert not run_is_dead(other)
    assert sweep_dead_runs(current) == []
    assert (other / "node0" / "containerd" / "root" / "snap" / "layer").is_file()
    assert (other / "test_a0" / "data" / "member").is_dir()


def test_a_live_run_and_folders_not_pytests_are_left_alone(tmp_path: Path) -> None:
    current = _run(tmp_path, "pytest-9", str(os.getpid()))
    live = _run(tmp_path, "pytest-5", str(os.getppid()))
    dead_pid = str(_dead_pid())
    stranger = _run(tmp_path, "pytest-current-x", dead_pid)
    (tmp_path / "pytest-4").symlink_to(stranger)
    assert sweep_dead_runs(current) == []
    for base in (live, stranger):
        assert (base / "node0" / "containerd").is_dir()


def test_a_killed_builds_stage_and_half_saved_archive_go(tmp_path: Path) -> None:
    stage = tmp_path / ".stage-abc123"
    (stage / "ctx").mkdir(parents=True)
    part = tmp_path / ".ghcr.io_kelastic_digits-example_0.1.0-0123456789abcdef.tar.77.part"
    part.write_bytes(b"half")
    archive = tmp_path / "ghcr.io_kelastic_digits-example_0.1.0-0123456789abcdef.tar"
    archive.write_bytes(b"whole")
    lock = tmp_path / ".lock"
    lock.touch()
    assert images.sweep_unfinished(tmp_path) == sorted([part, stage])
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", archive.name]


def test_an_import_without_room_fails_before_it_starts(tmp_path: Path) -> None:
    archive = tmp_path / "big.tar"
    with archive.open("wb") as fh:  # sparse: a huge size, no disk used
        fh.truncate(1 << 42)
    need = images.import_disk_need([archive])
    assert need == 2 * (1 << 42) + images.IMPORT_SLACK_BYTES
    with pytest.raises(images.ImageError, match=r"needs 8797\.2 GB free, .* has .*pytest-\*/node"):
        images.check_disk_for_import(tmp_path / "node0" / "containerd" / "root", [archive])
    small = tmp_path / "small.tar"
    small.write_bytes(b"x" * 1024)
    images.check_disk_for_import(tmp_path / "node0" / "containerd" / "root", [small])
