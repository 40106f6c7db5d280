"""Fixtures shared by the sidecar's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kelastic_etcd import EtcdClient


@pytest.fixture
def store(etcd_endpoint: str) -> Iterator[EtcdClient]:
    """A client of the session's real etcd, closed after the test."""
    s = EtcdClient([etcd_endpoint])
    yield s
    s.close()
