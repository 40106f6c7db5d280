"""Failure rules (``spec.failurePolicy.rules``): which failures fail the job, which are
not charged, which spend the restart budget; the one codec of their wire form.

The style of batch/v1 Job's ``podFailurePolicy`` and JobSet's failure policy: an ordered
list of rules, the first that matches a failure decides its :class:`FailureAction`. A rule
matches one thing, with an operator (``In`` / ``NotIn``) and values:

- ``onExitCodes``: the failed worker's exit code (1..255; a worker killed by a signal has
  none, so it matches no exit-code rule);
- ``onSignals``: the signal that killed it (1..64; a hung worker reaped by the timer
  server is a ``SIGKILL`` too: put a ``onCauses`` rule for ``hang`` first to tell them
  apart);
- ``onCauses``: kelastic's :class:`FailureCause` of the failure (:data:`RULE_CAUSES`:
  ``worker_failure``, ``hang``, ``node_lost``, ``start_failure``, ``oom``; scale events and
  peers' restarts are never failures). An OOM kill is a ``SIGKILL`` too: a ``FailJob``
  rule for ``oom`` stops a job whose batch does not fit from spending its budget on
  restarts that meet the same limit.

``NotIn`` matches a failure that has the thing matched (an exit code, a signal) and whose
value is not listed. No rule matching leaves today's behaviour: a ``start_failure`` fails
the job at once (not retried), anything else is counted.

The wire form is the CRD's (camelCase JSON), written by the operator into the sidecar's
:data:`ENV_FAILURE_POLICY` (:func:`encode_rules`) and read by the sidecar's config
(:func:`decode_rules`); :func:`parse_rules` also checks the operator's model, so the
model, the env and the sidecar refuse the same rules with the same words.
"""

from __future__ import annotations

import enum
import json
import signal
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

__all__ = [
    "ENV_FAILURE_POLICY",
    "MAX_RULES",
    "MAX_VALUES",
    "RULE_CAUSES",
    "FailureAction",
    "FailureCause",
    "FailurePolicyError",
    "FailureRule",
    "MatchOperator",
    "decode_rules",
    "encode_rules",
    "first_match",
    "parse_rules",
]

#: The sidecar's variable holding the rules, the JSON list of :func:`encode_rules`
#: (unset or empty: no rules).
ENV_FAILURE_POLICY: Final = "KELASTIC_FAILURE_POLICY"
#: Most rules in a policy (batch/v1 podFailurePolicy's bound).
MAX_RULES: Final = 20
#: Most values of one rule (batch/v1's bound for exit codes).
MAX_VALUES: Final = 255
#: Longest wire form :func:`decode_rules` reads, characters.
MAX_WIRE_CHARS: Final = 64 * 1024
#: Exit codes a rule may name (a process's exit status is 0..255; 0 is no failure).
EXIT_CODE_RANGE: Final = (0, 255)
#: Signal numbers a rule may name (Linux: 1..64, real-time signals included).
SIGNAL_RANGE: Final = (1, 64)


class FailurePolicyError(ValueError):
    """A failure policy is malformed; the message names the rule and the field."""


class FailureCause(enum.StrEnum):
    """Why a round failed or restarted, as recorded in the restart history, a node's
    report and the ``cause`` label of ``kelastic_restarts_total``; the failure rules name
    the failures (:data:`RULE_CAUSES`)."""

    #: A worker exited non-zero or was killed.
    WORKER_FAILURE = "worker_failure"
    #: The timer server reaped a worker whose timer expired.
    HANG = "hang"
    #: A peer's lease expired (its sidecar or machine died).
    NODE_LOST = "node_lost"
    #: A worker that never ran the program (exec failed, or exit 126/127: not
    #: executable, not found): a restart cannot help, so, unless a rule says otherwise,
    #: the job fails at once without spending the budget.
    START_FAILURE = "start_failure"
    #: A worker the kernel's OOM killer took (its container's memory cgroup counted the
    #: kill as it died of ``SIGKILL``: the launcher's ``oom`` in its ``exited`` message).
    OOM = "oom"
    #: Nodes joined or left; never charged to the budget.
    SCALE = "scale"
    #: Another node restarted the group; never charged.
    PEER = "peer_restart"


#: The causes a rule may name: the failures (scale events and peers' restarts are not).
RULE_CAUSES: Final = (
    FailureCause.WORKER_FAILURE,
    FailureCause.HANG,
    FailureCause.NODE_LOST,
    FailureCause.START_FAILURE,
    FailureCause.OOM,
)


class FailureAction(enum.StrEnum):
    """What a matching rule does with a failure."""

    #: Fail the job at once, naming the rule (nothing more is spent).
    FAIL_JOB = "FailJob"
    #: Restart the worker group without charging the restart budget.
    IGNORE = "Ignore"
    #: Charge the restart budget (``maxRestarts``): the behaviour without rules.
    COUNT = "Count"
    #: The failing node's Pod fails and the operator replaces it (``podReplacement``'s
    #: budget, not ``maxRestarts``); its peers re-rendezvous without it meanwhile.
    RESTART_POD = "RestartPod"


class MatchOperator(enum.StrEnum):
    """How a rule's values are matched."""

    IN = "In"
    NOT_IN = "NotIn"


#: A rule's matcher field -> what it matches (the words of :meth:`FailureRule.describe`).
_FIELDS: Final = {"onExitCodes": "exit code", "onSignals": "signal", "onCauses": "cause"}


@dataclass(frozen=True)
class FailureRule:
    """One rule: ``action`` for the failures whose ``field`` value is (``In``) or is not
    (``NotIn``) one of ``values``.

    Attributes:
        action: what the rule does.
        field: ``onExitCodes``, ``onSignals`` or ``onCauses``.
        operator: ``In`` or ``NotIn``.
        values: exit codes or signal numbers (ints), or :class:`FailureCause` values.
    """

    action: FailureAction
    field: str
    operator: MatchOperator
    values: tuple[int | str, ...]

    def matches(self, cause: str, exitcode: int | None, signum: int | None) -> bool:
        """Whether the rule matches a failure of ``cause`` (a :class:`FailureCause`
        value) whose worker exited with ``exitcode`` or was killed by ``signum`` (each
        None when not so)."""
        got: int | str | None
        if self.field == "onExitCodes":
            got = exitcode
        elif self.field == "onSignals":
            got = signum
        else:
            got = str(cause)
        if got is None:
            return False
        return (got in self.values) == (self.operator is MatchOperator.IN)

    def describe(self) -> str:
        """``FailJob: exit code 42``, ``Ignore: signal not in SIGKILL, SIGTERM``,
        ``Count: cause hang``."""
        what = _FIELDS[self.field]
        shown = ", ".join(_show(self.field, v) for v in self.values)
        op = " " if self.operator is MatchOperator.IN else " not in "
        return f"{self.action}: {what}{op}{shown}"

    def as_doc(self) -> dict[str, Any]:
        """The rule in the CRD's form (the inverse of :func:`parse_rules` for one rule)."""
        return {
            "action": str(self.action),
            self.field: {"operator": str(self.operator), "values": list(self.values)},
        }


def _show(field: str, value: int | str) -> str:
    if field == "onSignals" and isinstance(value, int):
        try:
            return signal.Signals(value).name
        except ValueError:
            return f"signal {value}"
    return str(value)


def describe(index: int, rule: FailureRule) -> str:
    """``rule 0 (FailJob: exit code 42)``: how the root cause and the job's condition
    name the rule at ``index`` of ``spec.failurePolicy.rules``."""
    return f"rule {index} ({rule.describe()})"


def first_match(
    rules: Iterable[FailureRule], cause: str, exitcode: int | None, signum: int | None
) -> tuple[int, FailureRule] | None:
    """The first rule matching the failure (see :meth:`FailureRule.matches`) and its
    index, or None when none does."""
    for index, rule in enumerate(rules):
        if rule.matches(cause, exitcode, signum):
            return index, rule
    return None


def _values(where: str, field: str, raw: Any) -> tuple[int | str, ...]:
    if not isinstance(raw, list) or not raw:
        raise FailurePolicyError(f"{where}.values must be a non-empty list")
    if len(raw) > MAX_VALUES:
        raise FailurePolicyError(f"{where}.values has {len(raw)} items; at most {MAX_VALUES}")
    out: list[int | str] = []
    for i, value in enumerate(raw):
        if field == "onCauses":
            allowed = [str(c) for c in RULE_CAUSES]
            if not isinstance(value, str) or value not in allowed:
                raise FailurePolicyError(
                    f"{where}.values[{i}]: {_short(value)} is no cause; one of "
                    + ", ".join(allowed)
                )
            out.append(value)
            continue
        lo, hi = EXIT_CODE_RANGE if field == "onExitCodes" else SIGNAL_RANGE
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            what = "an exit code" if field == "onExitCodes" else "a signal number"
            raise FailurePolicyError(
                f"{where}.values[{i}]: {_short(value)} is not {what} in {lo}..{hi}"
            )
        out.append(value)
    if len(set(out)) != len(out):
        raise FailurePolicyError(f"{where}.values lists a value twice")
    return tuple(out)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _rule(index: int, raw: Any) -> FailureRule:
    where = f"rules[{index}]"
    if not isinstance(raw, dict):
        raise FailurePolicyError(f"{where} must be a mapping")
    unknown = sorted(set(raw) - {"action", *_FIELDS})
    if unknown:
        raise FailurePolicyError(f"{where}: unknown field {_short(unknown[0])}")
    actions = [str(a) for a in FailureAction]
    action = raw.get("action")
    if not isinstance(action, str) or action not in actions:
        raise FailurePolicyError(
            f"{where}.action: {_short(action)} is no action; one of " + ", ".join(actions)
        )
    fields = [f for f in _FIELDS if f in raw]
    if len(fields) != 1:
        raise FailurePolicyError(
            f"{where} must have exactly one of onExitCodes, onSignals, onCauses"
        )
    (field,) = fields
    matcher = raw[field]
    where = f"{where}.{field}"
    if not isinstance(matcher, dict) or set(matcher) - {"operator", "values"}:
        raise FailurePolicyError(f"{where} must be a mapping of operator and values")
    operator = matcher.get("operator")
    if operator not in ("In", "NotIn"):
        raise FailurePolicyError(f"{where}.operator: {_short(operator)} is not In or NotIn")
    values = _values(where, field, matcher.get("values"))
    if field == "onExitCodes" and operator == "In" and 0 in values:
        raise FailurePolicyError(f"{where}.values: exit code 0 is no failure; In may not list it")
    return FailureRule(FailureAction(action), field, MatchOperator(operator), values)


def parse_rules(doc: Any) -> tuple[FailureRule, ...]:
    """Check and read the rules in the CRD's form (a list of mappings).

    Raises:
        FailurePolicyError: not a list, over :data:`MAX_RULES` rules, or a rule that is
            not a mapping, has an unknown field or action, not exactly one of
            ``onExitCodes``/``onSignals``/``onCauses``, an operator other than
            ``In``/``NotIn``, no values or over :data:`MAX_VALUES`, a value twice, an exit
            code outside 0..255 (0 with ``In``), a signal outside 1..64, a cause not in
            :data:`RULE_CAUSES` (booleans are not numbers).
    """
    if not isinstance(doc, list):
        raise FailurePolicyError("rules must be a list")
    if len(doc) > MAX_RULES:
        raise FailurePolicyError(f"rules has {len(doc)} rules; at most {MAX_RULES}")
    return tuple(_rule(i, r) for i, r in enumerate(doc))


def encode_rules(rules: Iterable[FailureRule]) -> str:
    """The wire form of ``rules`` (compact JSON; ``""`` for none), as
    :data:`ENV_FAILURE_POLICY` holds it.

    Raises:
        FailurePolicyError: the rules are not valid (they are checked as read back).
    """
    docs = [r.as_doc() for r in rules]
    if not docs:
        return ""
    parse_rules(docs)
    return json.dumps(docs, separators=(",", ":"))


def decode_rules(text: str) -> tuple[FailureRule, ...]:
    """Read :func:`encode_rules`'s wire form; ``""`` (or only blanks) is no rules.

    Raises:
        FailurePolicyError: over :data:`MAX_WIRE_CHARS`, not JSON, or rules that
            :func:`parse_rules` refuses. Never another exception, whatever ``text`` holds.
    """
    if not text.strip():
        return ()
    if len(text) > MAX_WIRE_CHARS:
        raise FailurePolicyError(f"longer than {MAX_WIRE_CHARS} characters")
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise FailurePolicyError(f"not JSON: {_short(str(exc))}") from None
    return parse_rules(doc)
