"""A local run's failed Pods, handled as the operator does (:mod:`~kelastic_operator.reconcile`,
rules 2, 5 and 8).

A Pod failed when its sidecar was killed (the node is lost) or its trainer failed on its
own, not because the job failed. Its node leaves the rendezvous at once (its alive key is
deleted, so its peers name the lost node as the cause instead of waiting a lease TTL), its
processes are stopped, and it is replaced after the ``podReplacement`` backoff while that
budget lasts (its folder is kept as ``pods/<pod>.replaced-<n>``); once it is spent the job
fails.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kelastic import contract

from ..model import ElasticJob
from ..reconcile import backoff_seconds
from ..rendezvous_store import EtcdRendezvousStore, RendezvousStoreError
from .replicas import Replica, Replicas


class ReplacementPolicy:
    """Notices failed Pods of ``replicas`` and replaces them, or fails the job.

    Args:
        job: the validated manifest (``spec.podReplacement``, the etcd prefix).
        run_id: the job's uid when the manifest has none.
        replicas: the run's replicas.
        stop_grace: seconds a worker gets between SIGTERM and SIGKILL.
        say: prints one line of runner output.
        endpoints: the etcd endpoints while the job runs (empty once it stops).
        restart: starts replica ``index`` again; False when the job no longer runs.
    """

    def __init__(
        self,
        job: ElasticJob,
        run_id: str,
        replicas: Replicas,
        stop_grace: float,
        say: Callable[[str], None],
        endpoints: Callable[[], list[str]],
        restart: Callable[[int], bool],
    ) -> None:
        self.job = job
        self.spec = job.spec
        self.run_id = run_id
        self.replicas = replicas
        self.stop_grace = stop_grace
        self.say = say
        self._endpoints = endpoints
        self._restart = restart
        self.replacements = 0  # failed Pods replaced so far (spec.podReplacement)
        self.replace_at: dict[int, float] = {}  # replica index -> monotonic time
        self.retired: list[Replica] = []  # failed Pods, stopped and replaced
        self.job_failure = ""  # why the job failed, when not a sidecar's report
        #: Set once the run stops: nothing is a failure any more.
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._rdzv: EtcdRendezvousStore | None = None

    def sidecar_exited(self, pod: Replica, code: int) -> None:
        """Take a dead sidecar's node out of the rendezvous the moment it dies (as the
        operator does when a Pod fails), so its peers name the lost node as the cause."""
        if code < 0 and not self.stopping.is_set():
            self._evict(pod)

    def _rendezvous_store(self) -> EtcdRendezvousStore:
        with self._lock:
            if self._rdzv is None:
                self._rdzv = EtcdRendezvousStore(self._endpoints(), timeout=2.0, time_retry=0.5)
            return self._rdzv

    def _evict(self, pod: Replica) -> None:
        """Delete the node's alive key: its peers see it lost at once (not a lease TTL
        later). Best effort: otherwise its lease expires by itself."""
        meta = self.job.metadata
        prefix = contract.job_prefix(meta.namespace, meta.name, meta.uid or self.run_id)
        try:
            self._rendezvous_store().remove_nodes(prefix, [pod.name])
        except (RendezvousStoreError, RuntimeError) as exc:
            self.say(f"{pod.name}: cannot take the node out of the rendezvous: {exc}")

    def check(self, pod: Replica) -> None:
        """Notice a failed Pod: its sidecar was killed, or the trainer failed on its own
        (not because the job failed). Then replace it, or fail the job.

        A sidecar that exits by itself reports why and tells its launcher first (the job
        failed, or its trainer died): the trainer's end decides then.
        """
        if pod.failed or self.stopping.is_set():
            return
        sidecar = pod.sidecar.proc.poll() if pod.sidecar is not None else None
        trainer = pod.launcher.poll()
        why = ""
        if sidecar == contract.SIDECAR_EXIT_CONFIG and trainer is None and pod.sidecar is not None:
            # it cannot run with its configuration (its env, a checkpoint volume too
            # small): a new Pod would fail alike, and its launcher waits for it for ever
            self.job_failure = f"{pod.name}: its kelastic sidecar {exit_text(sidecar)}: " + (
                _last_line(pod.sidecar.log) or f"see {pod.sidecar.log}"
            )
            return
        if sidecar is not None and sidecar < 0 and trainer != 0:
            why = f"its kelastic sidecar {exit_text(sidecar)}: node lost"
        elif trainer not in (None, 0) and not pod.job_failed():
            said = pod.termination_message().splitlines()[:1]  # e.g. its preflight's failure
            why = f"its trainer {exit_text(trainer)}" + (f" ({said[0][:400]})" if said else "")
            if pod.sidecar is not None and sidecar is None:
                return  # wait for its sidecar: it reports the job failed or not
        if not why:
            return
        pod.failed = why
        pod.status = {**pod.status, "phase": "lost"}
        self._evict(pod)
        self.say(f"{pod.name} failed: {why}; see {pod.dir}")
        pod.local.stop(self.stop_grace)
        policy = self.spec.pod_replacement
        finishing = any(p.launcher.returncode == 0 for p in self.replicas.pods)
        if finishing:
            return  # the job is finishing: nothing to replace
        if self.replacements >= policy.max_replacements:
            self.job_failure = (
                f"{pod.name} failed ({why}) and the pod replacement budget "
                f"({policy.max_replacements}) is spent"
            )
            return
        delay = backoff_seconds(self.spec, self.replacements)
        self.replace_at[pod.index] = time.monotonic() + delay
        self.say(
            f"replacing {pod.name} in {delay:.1f}s (replacement "
            f"{self.replacements + 1}/{policy.max_replacements})"
        )

    def replace_due(self) -> None:
        """Start the replacements whose backoff has passed."""
        now = time.monotonic()
        for index, when in sorted(self.replace_at.items()):
            if when > now:
                continue
            del self.replace_at[index]
            old = self.replicas.pods[index]
            self.replacements += 1
            self.retired.append(old)
            with contextlib.suppress(OSError):
                old.dir.rename(old.dir.with_name(f"{old.name}.replaced-{self.replacements}"))
            if not self._restart(index):
                return
            self.say(f"{old.name}: replaced (replacement {self.replacements})")

    def close(self) -> None:
        """Close the rendezvous connection (if one was opened)."""
        if self._rdzv is not None:
            self._rdzv.close()


def _last_line(path: Path) -> str:
    """The last non-empty line of a log (at most 1000 characters), or ``""``."""
    with contextlib.suppress(OSError), open(path, "rb") as f:
        f.seek(max(0, f.seek(0, 2) - 8192))
        lines = [x for x in f.read().decode(errors="replace").splitlines() if x.strip()]
        return lines[-1][:1000] if lines else ""
    return ""


def exit_text(code: int) -> str:
    """``exited with code 1`` / ``was killed by SIGKILL`` for a Popen return code."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"
