"""kelastic.checkpoint.volume: the quantity of spec.checkpoint.memory, and the volume
allocated and written in full (a real tmpfs too small fails with the bytes named)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kelastic.checkpoint import CheckpointSpaceError
from kelastic.checkpoint.volume import parse_quantity, touch_volume

REPO = Path(__file__).resolve().parents[2]


def test_quantities() -> None:
    assert parse_quantity("64Mi") == 64 << 20
    assert parse_quantity("3k") == 3000
    assert parse_quantity("7") == 7
    for bad in ("0", "1.5Gi", "1Gib", " 1Gi", "1e3", "", "Ki", "9" * 16):
        with pytest.raises(ValueError, match="expected a positive integer"):
            parse_quantity(bad)


def test_a_volume_that_holds_the_size_is_touched_and_left_empty(tmp_path: Path) -> None:
    touch_volume(tmp_path, (5 << 20) + 123)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(CheckpointSpaceError, match=r"cannot hold .*spec.checkpoint.memory"):
        touch_volume(tmp_path, 1 << 50)
    with pytest.raises(FileNotFoundError):
        touch_volume(tmp_path / "missing", 4096)


_CHILD = """
import sys
from pathlib import Path
from kelastic.checkpoint import CheckpointSpaceError, _slotfile, volume
folder = Path(sys.argv[1])
volume.touch_volume(folder, 6 << 20)
print("fits: 6 MiB")
try:
    volume.touch_volume(folder, 16 << 20)
except CheckpointSpaceError as exc:
    print("too small:", exc.needed, exc.free)
volume.free_bytes = lambda d: -1  # past the free-space check: the allocation refuses
try:
    volume.touch_volume(folder, 16 << 20)
except CheckpointSpaceError as exc:
    print("refused:", exc.needed, "No space" in str(exc))
print("left:", sorted(p.name for p in folder.iterdir()))
"""


def test_a_small_tmpfs_fails_at_once_naming_the_size(tmp_path: Path) -> None:
    """A real 8 MiB tmpfs, mounted in a private mount namespace (``unshare -m``)."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs unshare and root to mount a tmpfs in a private mount namespace")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(_CHILD))
    shell = (f"mount -t tmpfs -o size=8m kelastic-test {mnt} && "
             f"exec {sys.executable} {script} {mnt}")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "worker_lib")])}
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", shell],
                          capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    if proc.returncode and "mount" in proc.stderr and "fits" not in proc.stdout:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()[:200]}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines())
    needed, free = map(int, lines["too small"].split())
    assert needed == 16 << 20 and 6 << 20 <= free < needed
    assert lines["refused"] == f"{16 << 20} True"
    assert lines["left"] == "[]"
