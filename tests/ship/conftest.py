"""Fixtures of the ship tests: the Kubernetes API emulator's (tests/k8s)."""

from __future__ import annotations

from tests.k8s.conftest import k8s_api

__all__ = ["k8s_api"]
