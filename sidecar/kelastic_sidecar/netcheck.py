"""The network preflight check of a round (``spec.preflight.network``), the sidecar's side:
a part of the supervisor, run after a round's rendezvous completes and before its workers
start.

Each node's sidecar sends its launcher a ``check`` with the round's params (its group
rank, the group world size, the round's master address, the job's floors); the
launcher's checker (:mod:`kelastic.netcheck`, in the trainer container, where torch and
the job's network are) runs the group's gloo all-reduce with the other nodes' checkers
and, when the floors are missed, the pair tests that name the bad nodes; every node gets
the same verdict (:func:`kelastic.netcheck.decode_verdict`, the one codec), so each
decides alone and all decide alike:

- **passed**: the workers start;
- **this node failed**: it leaves the rendezvous and fails its Pod with a message that
  begins with :data:`kelastic.contract.PREFLIGHT_FAILED_PREFIX` (the operator quarantines
  its Node and replaces the Pod, charged to ``podReplacement``, not to ``maxRestarts``),
  exactly as a failed ``spec.preflight.command``;
- **other nodes failed**: it rendezvouses again (nothing charged); the bad nodes do not
  join, so the round forms without them;
- **inconclusive** (the group could not form, a step timed out, two nodes whose link is
  slow, no answer from the launcher): the workers start. The check never makes a round
  worse than no check: a node it cannot judge is judged by its workers' failures, as
  without it.

The check runs on each round whose workers start as new processes (not one an in-process
restart carried over), with at least two nodes. It reuses the round's master port: the
checker on group rank 0 serves its store there and has exited before that node's workers
start (the launcher answers ``checked`` only after the checker's output ended).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kelastic import contract
from kelastic.control_messages import Check, Checked
from kelastic.netcheck import NetcheckError, Params, Setting, Verdict, decode_verdict, encode_params

from .control import Disconnected
from .rendezvous import RendezvousInfo
from .vocabulary import CheckOutcome

__all__ = ["CheckOutcome", "CheckResult", "NetworkCheck"]

log = logging.getLogger("kelastic_sidecar.netcheck")

#: Seconds the sidecar waits for ``checked`` beyond the checker's own deadline (the
#: launcher's kill and answer; an older launcher that ignores ``check`` costs this once).
ANSWER_GRACE = 15.0


@dataclass(frozen=True)
class CheckResult:
    """A round's check: ``outcome``, ``text`` (one line for the log, the report and the
    Pod's termination message) and the ``verdict`` when the checker gave one."""

    outcome: CheckOutcome
    text: str
    verdict: Verdict | None = None


#: ``send(message)`` to the launcher; ``wait(round, timeout_s)``: its ``checked`` of the
#: round, its disconnection, or None at the timeout.
Send = Callable[[Check], object]
Wait = Callable[[int, float], "Checked | Disconnected | None"]


class NetworkCheck:
    """The supervisor's network check part.

    Args:
        setting: the job's check (``$KELASTIC_NETCHECK``); None: no check.
        node: this node's name (for the texts).
        send, wait: the control socket's send and the attempt monitor's ``wait_checked``.
        observe: called with each outcome and its seconds (metrics); optional.
        launcher_checks: whether the launcher answers ``check`` (its ``hello`` said so; an
            older launcher's does not, and it is never asked: it would ignore the message
            and the round would wait for the whole deadline).
    """

    def __init__(
        self,
        setting: Setting | None,
        node: str,
        send: Send,
        wait: Wait,
        observe: Callable[[CheckOutcome, float], None] | None = None,
        launcher_checks: Callable[[], bool] = lambda: True,
    ) -> None:
        self.setting = setting
        self.node = node
        self._send = send
        self._wait = wait
        self._observe = observe
        self._launcher_checks = launcher_checks
        self._skew_told = False

    def applies(self, info: RendezvousInfo, carried: bool) -> bool:
        """Whether ``info``'s round runs the check: a setting, two nodes or more, workers
        that start as new processes (``carried``: an in-process restart keeps them), and a
        launcher that answers ``check``."""
        if self.setting is None or info.group_world_size < 2 or carried:
            return False
        if not self._launcher_checks():
            if not self._skew_told:
                log.warning("the job has a network check but this node's launcher is older "
                            "and cannot run it; its rounds start without it")  # fmt: skip
                self._skew_told = True
            return False
        return True

    def gate(
        self, info: RendezvousInfo, master: tuple[str, int], carried: bool
    ) -> CheckResult | None:
        """:meth:`run` when :meth:`applies`, else None (the workers start)."""
        return self.run(info, master) if self.applies(info, carried) else None

    def run(self, info: RendezvousInfo, master: tuple[str, int]) -> CheckResult:
        """Run the check of ``info``'s round with the round's ``master`` (address, port)
        and decide for this node (see the module's rules). Never raises: every problem
        is an inconclusive result."""
        assert self.setting is not None
        started = time.monotonic()
        params = Params(round=info.round, rank=info.group_rank,
                        world_size=info.group_world_size, master_addr=master[0],
                        master_port=master[1], timeout_s=self.setting.timeout_s,
                        floors=self.setting.floors)  # fmt: skip
        deadline = self.setting.deadline()
        self._send(Check(round=info.round, params=encode_params(params), timeout=deadline))
        answer = self._wait(info.round, deadline + ANSWER_GRACE)
        result = self._decide(info, answer)
        took = time.monotonic() - started
        level = logging.INFO if result.outcome is CheckOutcome.PASSED else logging.WARNING
        log.log(level, "round %d network check (%.2f s): %s", info.round, took, result.text)
        if self._observe is not None:
            self._observe(result.outcome, took)
        return result

    def _decide(self, info: RendezvousInfo, answer: Checked | Disconnected | None) -> CheckResult:
        if answer is None:
            return _inconclusive("the launcher did not answer the check (an older launcher?)")
        if isinstance(answer, Disconnected):
            return _inconclusive("the launcher disconnected during the check")
        if answer.verdict is None:
            return _inconclusive(answer.error or "no verdict")
        try:
            verdict = decode_verdict(answer.verdict)
        except NetcheckError as exc:
            return _inconclusive(f"the checker's verdict is not one: {exc}")
        if verdict.round != info.round:
            return _inconclusive(f"a verdict of round {verdict.round}, not {info.round}")
        measured = (f"all-reduce latency {verdict.latency_s * 1e3:.2f} ms, bandwidth "
                    f"{verdict.bandwidth_bps / 1e6:.1f} MB/s")  # fmt: skip
        if verdict.failed.get(info.group_rank):
            why = verdict.failed[info.group_rank]
            return CheckResult(CheckOutcome.SELF_FAILED, f"{contract.PREFLIGHT_FAILED_PREFIX}"
                               f"{self.node}: network check of round {info.round}: {why} "
                               f"({measured})", verdict)  # fmt: skip
        if verdict.failed:
            ranks = ", ".join(str(r) for r in sorted(verdict.failed))
            return CheckResult(CheckOutcome.PEERS_FAILED, f"group ranks {ranks} failed the "
                               f"network check ({measured}); rendezvous again without them",
                               verdict)  # fmt: skip
        if not verdict.passed:
            return _inconclusive(verdict.inconclusive or "the floors were missed and no node "
                                 "was named", verdict)  # fmt: skip
        return CheckResult(CheckOutcome.PASSED, f"passed: {measured}", verdict)


def _inconclusive(why: str, verdict: Verdict | None = None) -> CheckResult:
    return CheckResult(CheckOutcome.INCONCLUSIVE, f"inconclusive ({why}); the workers start",
                       verdict)  # fmt: skip
