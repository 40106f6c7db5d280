"""What the node's workers loaded as a round began, told to the operator: a part of
:class:`~kelastic_sidecar.checkpoints.RoundCheckpoints`.

The sidecars agree on a round's step before its workers start; each worker's
``kelastic.checkpoint.load()`` then leaves ``rank-<R>.restored`` beside its slots (the
round, the step, the seconds it took: :mod:`kelastic.checkpoint.restored`). This part's
thread looks for those records after each start of the workers with a step to load, and
once every worker of the node has loaded that step writes one value,
``checkpoint-loads/<node>`` (:mod:`kelastic.etcd_values.loads`: the round, the step, the
tier, the ranks, the slowest load's seconds), from which the operator says in
``status.lastCheckpoint`` how long the restore took the job (``loadSeconds``), not only
where it came from.

It looks every 0.2 s for the first 10 s after a start, then every 2 s (a trainer that
never calls ``load()`` costs a folder listing every 2 s, and nothing is written for it),
and stops at the next start or after an hour. A write that fails is logged and not
retried: the status lacks the load time of that round, nothing else.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kelastic.checkpoint.restored import read_restored
from kelastic.etcd_values.loads import LoadDoc, encode_load
from kelastic_etcd import EtcdClient, EtcdError

__all__ = ["LoadReporter"]

log = logging.getLogger("kelastic_sidecar.checkpoints")

#: Poll period for the first :data:`_FAST_FOR` seconds after a start, then :data:`_SLOW`.
_FAST: float = 0.2
_FAST_FOR: float = 10.0
_SLOW: float = 2.0
#: How long a start's loads are looked for, seconds.
_GIVE_UP: float = 3600.0


@dataclass(frozen=True)
class _Wanted:
    round: int
    step: int
    tier: str
    ranks: int
    since: float


class LoadReporter:
    """Writes ``key`` once the node's workers have all loaded a round's step (see the
    module doc).

    Args:
        store: the node's etcd client; key: :meth:`kelastic.contract.Keys.checkpoint_load`.
        directory: the slot folder the workers' records are in.

    Attributes:
        written: the values written; looks: the folder's readings so far.
    """

    def __init__(self, store: EtcdClient, key: str, directory: Path) -> None:
        self._store, self._key, self._directory = store, key, directory
        self._cond = threading.Condition()
        self._wanted: _Wanted | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self.written: list[LoadDoc] = []
        self.looks = 0

    def begin(self, round_: int, step: int, tier: str, ranks: int) -> None:
        """The node's ``ranks`` workers start in ``round_`` to load ``step`` from
        ``tier``: look for their records (what an earlier start waited for is dropped)."""
        with self._cond:
            if self._closed or ranks < 1:
                return
            self._wanted = _Wanted(round_, step, tier, ranks, time.monotonic())
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="checkpoint-loads",
                                                daemon=True)  # fmt: skip
                self._thread.start()
            self._cond.notify_all()

    def close(self) -> None:
        """Stop looking (the thread ends within one poll)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        thread = self._thread
        if thread is not None:
            thread.join(5.0)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and self._wanted is None:
                    self._cond.wait()
                if self._closed:
                    return
                wanted = self._wanted
                assert wanted is not None
            waited = time.monotonic() - wanted.since
            done = self._look(wanted) if waited < _GIVE_UP else True
            with self._cond:
                if done and self._wanted is wanted:
                    self._wanted = None
                elif not self._closed and self._wanted is wanted:
                    self._cond.wait(_FAST if waited < _FAST_FOR else _SLOW)

    def _look(self, wanted: _Wanted) -> bool:
        """Whether the start's loads are dealt with: all there and written (or the write
        failed, logged), else False (look again)."""
        loads = [r for r in read_restored(self._directory, wanted.round)
                 if r.step == wanted.step]  # fmt: skip
        self.looks += 1
        if len(loads) < wanted.ranks:
            return False
        doc = LoadDoc(wanted.round, wanted.step, wanted.tier, len(loads),
                      max(r.seconds for r in loads), time.time())  # fmt: skip
        try:
            self._store.put(self._key, encode_load(doc))
        except EtcdError as exc:
            log.warning("checkpoint loads of round %d: not written (%s): the job's status "
                        "lacks their time", wanted.round, exc)  # fmt: skip
            return True
        self.written.append(doc)
        log.info("round %d: all %d workers loaded step %d from %s, the slowest in %.3f s",
                 doc.round, doc.ranks, doc.step, doc.tier, doc.seconds)  # fmt: skip
        return True
