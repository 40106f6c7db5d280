"""The former home of :class:`~kelastic_etcd.watcher.Watcher`, kept importable."""

from __future__ import annotations

from kelastic_etcd.watcher import Watcher

__all__ = ["Watcher"]
