"""Fixtures shared by the sidecar's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kelastic_sidecar.etcd_store import EtcdStore


@pytest.fixture
def store(etcd_endpoint: str) -> Iterator[EtcdStore]:
    """A client of the session's real etcd, closed after the test."""
    s = EtcdStore([etcd_endpoint])
    yield s
    s.close()
