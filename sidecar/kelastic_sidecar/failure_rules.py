"""What the supervisor does with a failed round: ``spec.failurePolicy``'s first matching
rule (:mod:`kelastic.failure_policy`), else today's default.

Pure: :func:`verdict` turns the job's rules and a :class:`~kelastic_sidecar.failure.Failure`
into a :class:`Verdict`; the supervisor charges the budget, fails the job or its own Pod
as it says. Applied by the sidecar of the node that saw the failure (the node of the
failed worker, or the peers of a lost node), where the budget is charged today.

Without a matching rule: a ``start_failure`` fails the job at once (not retried, as
before the rules), anything else is counted against ``maxRestarts``.

A limit: with collectives, a peer whose workers fail in consequence (e.g. gloo's
"Connection closed by peer" after the faulty rank died) sees a failure of its own, which
its rules judge; the round is charged once, by whichever node charges first. A rule
meant to keep a fault uncharged should also cover what it does to the peers.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kelastic.failure_policy import FailureAction, FailureRule, describe, first_match

from .failure import CAUSE_START_FAILURE, Failure
from .vocabulary import DEPARTURE_REJOIN

__all__ = ["POD_RESTART_DEPARTURE", "Verdict", "verdict"]
#: The departure reason a RestartPod node leaves its round with: a planned one, so its
#: peers re-form without charging the budget (the Pod's replacement is the operator's).
POD_RESTART_DEPARTURE = DEPARTURE_REJOIN
log = logging.getLogger("kelastic_sidecar")


@dataclass(frozen=True)
class Verdict:
    """What to do with a failure.

    Attributes:
        action: the rule's action, or the default one (FailJob for a start failure,
            else Count).
        rule: how the root cause names the rule, ``rule 0 (FailJob: exit code 42)``;
            ``""`` when no rule matched.
    """

    action: FailureAction
    rule: str = ""

    @property
    def charged(self) -> bool:
        """Whether the failure goes to the restart record: Count spends a restart of
        ``maxRestarts``; Ignore is recorded without one, unless the record shows it
        ignored over and over (:meth:`~kelastic_sidecar.restart_budget.RestartBudget.charge`
        counts it then)."""
        return self.action in (FailureAction.COUNT, FailureAction.IGNORE)

    @property
    def ignored(self) -> bool:
        """An Ignore rule decided it."""
        return self.action is FailureAction.IGNORE

    def ends(self, exhausted: bool) -> bool:
        """Whether this node stops: FailJob and RestartPod always, Count (and an Ignore
        past its cap, which is counted) when the budget is ``exhausted``."""
        if self.action in (FailureAction.COUNT, FailureAction.IGNORE):
            return exhausted
        return True

    def close_reason(self, max_restarts: int) -> tuple[str, object]:
        """The key and value added to the rendezvous' closed reason when the job fails
        (read back by :func:`~kelastic_sidecar.round_end.closed_outcome`):
        ``failure_rule`` naming the rule, ``not_retried`` (a start failure without a
        rule), or ``max_restarts`` (the budget spent)."""
        if self.rule and self.action is FailureAction.FAIL_JOB:
            return "failure_rule", self.rule
        if self.action is FailureAction.FAIL_JOB:
            return "not_retried", True
        return "max_restarts", max_restarts

    def why(self, max_restarts: int) -> str:
        """Why the job fails, for the log: the rule, a start failure, or the budget."""
        key, value = self.close_reason(max_restarts)
        if key == "failure_rule":
            return f"spec.failurePolicy {value} applies"
        if key == "not_retried":
            return "a worker could not be started"
        return f"restart budget of {max_restarts} spent"

    def pod_summary(self, failure: Failure) -> str:
        """The RestartPod report and termination message: not a job failure (no
        ``job failed`` prefix), so the operator replaces the Pod."""
        return f"pod restart asked by spec.failurePolicy {self.rule}: {failure.summary()}"


def verdict(rules: Sequence[FailureRule], failure: Failure, node: str | None = None) -> Verdict:
    """The first rule of ``rules`` matching ``failure`` (its cause, exit code, signal),
    or the default; a matching rule is logged with the failure it decided. Judged on
    ``node``: a ``RestartPod`` rule matching another node's failure (a lost node, judged by
    every survivor) is counted instead, so the survivors' Pods are not all replaced."""
    found = first_match(rules, failure.cause, failure.exitcode, failure.signal)
    if found is None:
        default = FailureAction.FAIL_JOB if failure.cause == CAUSE_START_FAILURE else None
        return Verdict(default or FailureAction.COUNT)
    index, rule = found
    decided = Verdict(rule.action, describe(index, rule))
    if rule.action is FailureAction.RESTART_POD and node is not None and failure.node != node:
        log.warning("round %d: spec.failurePolicy %s matches %s, another node's failure: "
                    "counted here (a RestartPod restarts its own node's Pod)", failure.round,
                    decided.rule, failure.summary())  # fmt: skip
        return Verdict(FailureAction.COUNT, decided.rule)
    log.warning("round %d: spec.failurePolicy %s applies to %s", failure.round, decided.rule,
                failure.summary())  # fmt: skip
    return decided


def in_process_allowed(rules: Sequence[FailureRule], failure: Failure) -> bool:
    """Whether an in-process rung (the hybrid rung: a worker's death) may take
    ``failure``: no rule matches it, or the matching rule restarts (``Count``,
    ``Ignore``). ``FailJob`` ("restarting cannot fix this") and ``RestartPod`` ("not on
    this host") go to the process path, where the rule applies, instead of a respawn on
    the same host."""
    found = first_match(rules, failure.cause, failure.exitcode, failure.signal)
    return found is None or found[1].action in (FailureAction.COUNT, FailureAction.IGNORE)
