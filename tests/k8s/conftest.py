"""Fixtures of the in-memory Kubernetes API emulator (see README.md in this folder)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .harness import K8sApi


@pytest.fixture
def k8s_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[K8sApi]:
    """A fresh emulator per test (it starts in milliseconds), with KUBECONFIG pointing at it
    for the test's duration (subprocesses inherit it; the ``kubernetes`` package reads
    KUBECONFIG at import, so prefer ``k8s_api.api_client()`` or pass ``k8s_api.kubeconfig``)."""
    with K8sApi(tmp_path / "k8s") as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig))
        monkeypatch.setenv("KUBECACHEDIR", str(api.cache_dir))
        yield api
