"""kelastic._oom: the launcher's OOM-kill counter, on cgroup files laid out as the kernel
(v1, v2) and a container's mount (its own cgroup at the hierarchy's root) show them. The
real OOM killer under a container's limit: tests/operator/test_e2e_node_faults.py."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from kelastic._oom import MemoryCgroup, OomWatch, find_memory_cgroup

V1_CONTROL = "oom_kill_disable 0\nunder_oom 0\noom_kill {n}\n"
V2_EVENTS = "low 0\nhigh 0\nmax 3\noom 1\noom_kill {n}\noom_group_kill 0\n"


def _v1(root: Path, folder: str, kills: int, limit: str) -> Path:
    d = root / "memory" / folder.lstrip("/")
    d.mkdir(parents=True, exist_ok=True)
    (d / "memory.oom_control").write_text(V1_CONTROL.format(n=kills))
    (d / "memory.limit_in_bytes").write_text(limit + "\n")
    return d


def _proc(tmp: Path, text: str) -> Path:
    path = tmp / "cgroup"
    path.write_text(text)
    return path


def test_v1_reads_the_processs_own_cgroup(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    _v1(root, "/", 7, "9223372036854771712")  # the root: other counts, no limit
    d = _v1(root, "/kubepods/pod1/abc", 0, str(200 << 20))
    proc = _proc(tmp_path, "4:memory:/kubepods/pod1/abc\n3:cpu,cpuacct:/x\n0::/\n")
    cgroup = find_memory_cgroup(root, proc)
    assert cgroup is not None and cgroup.events == d / "memory.oom_control"
    watch = OomWatch(cgroup)
    assert watch.new_kills() == 0
    (d / "memory.oom_control").write_text(V1_CONTROL.format(n=2))
    assert watch.new_kills() == 2 and watch.new_kills() == 0
    assert watch.describe() == "killed by the OOM killer: its container's memory limit is 200 MiB"


def test_in_a_container_the_mounts_root_is_its_own_cgroup(tmp_path: Path) -> None:
    """runc on cgroup v1 mounts the container's cgroup at /sys/fs/cgroup/memory while
    /proc/self/cgroup still names the host's path."""
    root = tmp_path / "fs"
    _v1(root, "/", 1, str(1 << 30))
    proc = _proc(tmp_path, "9:memory:/kubepods/burstable/pod9/cid\n")
    cgroup = find_memory_cgroup(root, proc)
    assert cgroup is not None and cgroup.events == root / "memory" / "memory.oom_control"
    assert OomWatch(cgroup).describe().endswith("memory limit is 1 GiB")


def test_v2_and_no_limit(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    d = root / "user.slice" / "job"
    d.mkdir(parents=True)
    (d / "memory.events").write_text(V2_EVENTS.format(n=0))
    (d / "memory.max").write_text("max\n")
    cgroup = find_memory_cgroup(root, _proc(tmp_path, "0::/user.slice/job\n"))
    assert cgroup is not None and cgroup.limit_bytes() is None
    watch = OomWatch(cgroup)
    (d / "memory.events").write_text(V2_EVENTS.format(n=1))
    assert watch.new_kills() == 1
    assert "no memory limit" in watch.describe()


def test_no_memory_cgroup_never_reports(tmp_path: Path) -> None:
    assert find_memory_cgroup(tmp_path / "none", _proc(tmp_path, "garbage\n")) is None
    watch = OomWatch(None, find=False)
    assert watch.new_kills() == 0 and "OOM killer" in watch.describe()


def test_a_counter_that_goes_back_counts_nothing(tmp_path: Path) -> None:
    """A re-created cgroup (the counter reset) must not read as kills."""
    d = _v1(tmp_path / "fs", "/c", 5, "100")
    watch = OomWatch(MemoryCgroup(d / "memory.oom_control", d / "memory.limit_in_bytes"))
    (d / "memory.oom_control").write_text(V1_CONTROL.format(n=1))
    assert watch.new_kills() == 0
    (d / "memory.oom_control").write_text(V1_CONTROL.format(n=6))
    assert watch.new_kills() == 1  # past the highest seen


@settings(max_examples=300, deadline=None)
@given(events=st.text(max_size=300), limit=st.text(max_size=40))
def test_hostile_cgroup_files_never_raise(
    tmp_path_factory: object, events: str, limit: str
) -> None:
    """Whatever the files hold (huge ints, garbage, NaN), the reader returns a bounded int
    or None."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "e").write_text(events + "\noom_kill 99999999999999999999999\n")
        (d / "l").write_text(limit)
        cgroup = MemoryCgroup(d / "e", d / "l")
        kills = cgroup.oom_kills()
        assert kills is None or 0 <= kills < 10**19
        lim = cgroup.limit_bytes()
        assert lim is None or 0 <= lim < 1 << 62
        assert isinstance(OomWatch(cgroup).describe(), str)
