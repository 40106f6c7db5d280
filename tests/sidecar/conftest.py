"""Fixtures shared by the sidecar's tests."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from kelastic_etcd import EtcdClient


@pytest.fixture
def store(etcd_endpoint: str) -> Iterator[EtcdClient]:
    """A client of the session's real etcd, closed after the test."""
    s = EtcdClient([etcd_endpoint])
    yield s
    s.close()


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts (appended to the list), killed and waited for after it."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
