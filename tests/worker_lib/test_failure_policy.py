"""kelastic.failure_policy: the rules' codec (hostile input refused with a clear message,
never another exception), matching, first match, and how a rule is named."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kelastic.failure_policy import (
    MAX_RULES,
    MAX_VALUES,
    MAX_WIRE_CHARS,
    RULE_CAUSES,
    FailureAction,
    FailurePolicyError,
    FailureRule,
    MatchOperator,
    decode_rules,
    describe,
    encode_rules,
    first_match,
    parse_rules,
)


def rule(action: str = "FailJob", field: str = "onExitCodes", op: str = "In",
         values: list[Any] | None = None) -> dict[str, Any]:  # fmt: skip
    return {"action": action, field: {"operator": op, "values": [42] if values is None else values}}


def test_rules_round_trip_through_the_wire_form() -> None:
    rules = parse_rules([
        rule(), rule("Ignore", "onSignals", "NotIn", [9, 15]),
        rule("Count", "onCauses", "In", ["hang", "node_lost"]), rule("RestartPod"),
    ])  # fmt: skip
    assert rules[1] == FailureRule(FailureAction.IGNORE, "onSignals", MatchOperator.NOT_IN, (9, 15))
    assert decode_rules(encode_rules(rules)) == rules
    assert encode_rules(()) == "" and decode_rules("") == () and decode_rules("  ") == ()


def test_rules_are_named_for_the_root_cause() -> None:
    rules = parse_rules([rule(), rule("Ignore", "onSignals", "NotIn", [9, 15]),
                         rule("Count", "onCauses", "In", ["hang"]),
                         rule(values=[1, 2])])  # fmt: skip
    assert [describe(i, r) for i, r in enumerate(rules)] == [
        "rule 0 (FailJob: exit code 42)",
        "rule 1 (Ignore: signal not in SIGKILL, SIGTERM)",
        "rule 2 (Count: cause hang)",
        "rule 3 (FailJob: exit code 1, 2)",
    ]
    (odd,) = parse_rules([rule(field="onSignals", values=[63])])
    assert "SIGRTMAX-1" in odd.describe() or "signal 63" in odd.describe()


@pytest.mark.parametrize(
    ("cause", "code", "signum", "expected"),
    [
        ("worker_failure", 42, None, 0),  # exit code 42
        ("worker_failure", 1, None, 1),  # NotIn [42]: any other code
        ("hang", None, 9, 2),  # a hang is a SIGKILL too: the cause rule comes first
        ("worker_failure", None, 9, 3),  # SIGKILL, not a hang
        ("node_lost", None, None, 4),  # nothing but its cause
        ("worker_failure", None, 15, None),  # SIGTERM: no rule matches
    ],
)  # fmt: skip
def test_the_first_matching_rule_decides(
    cause: str, code: int | None, signum: int | None, expected: int | None
) -> None:
    rules = parse_rules([
        rule("FailJob", "onExitCodes", "In", [42]),
        rule("Count", "onExitCodes", "NotIn", [42]),
        rule("Ignore", "onCauses", "In", ["hang"]),
        rule("RestartPod", "onSignals", "In", [9]),
        rule("Ignore", "onCauses", "NotIn", ["worker_failure", "hang"]),
    ])  # fmt: skip
    found = first_match(rules, cause, code, signum)
    assert (found[0] if found else None) == expected


def test_not_in_needs_the_thing_it_matches() -> None:
    # a worker killed by a signal has no exit code: NotIn does not match it
    (exit_rule,) = parse_rules([rule(op="NotIn", values=[0])])
    assert exit_rule.matches("worker_failure", 3, None)
    assert not exit_rule.matches("worker_failure", None, 9)
    assert not exit_rule.matches("node_lost", None, None)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"rules": []}, "rules must be a list"),
        ([rule()] * (MAX_RULES + 1), f"at most {MAX_RULES}"),
        (["FailJob"], "rules[0] must be a mapping"),
        ([{"action": "Retry", "onExitCodes": {"operator": "In", "values": [1]}}],
         "rules[0].action: 'Retry' is no action; one of FailJob, Ignore, Count, RestartPod"),
        ([{"action": "FailJob"}], "exactly one of onExitCodes, onSignals, onCauses"),
        ([{**rule(), "onSignals": {"operator": "In", "values": [9]}}], "exactly one of"),
        ([{**rule(), "onOOM": True}], "unknown field 'onOOM'"),
        ([rule(op="in")], "rules[0].onExitCodes.operator: 'in' is not In or NotIn"),
        ([{"action": "FailJob", "onExitCodes": {"operator": "In"}}], "non-empty list"),
        ([rule(values=[])], "rules[0].onExitCodes.values must be a non-empty list"),
        ([rule(values=[*range(1, 256), 1])], f"at most {MAX_VALUES}"),
        ([rule(values=[10**30])], "is not an exit code in 0..255"),
        ([rule(values=[2**63])], "is not an exit code in 0..255"),
        ([rule(values=[-1])], "is not an exit code in 0..255"),
        ([rule(values=[256])], "is not an exit code in 0..255"),
        ([rule(values=[True])], "True is not an exit code"),
        ([rule(values=[1.0])], "1.0 is not an exit code"),
        ([rule(values=["42"])], "'42' is not an exit code"),
        ([rule(values=[0])], "exit code 0 is no failure; In may not list it"),
        ([rule(values=[3, 3])], "lists a value twice"),
        ([rule(field="onSignals", values=[0])], "is not a signal number in 1..64"),
        ([rule(field="onSignals", values=[65])], "is not a signal number in 1..64"),
        ([rule(field="onCauses", values=["scale"])], "'scale' is no cause; one of worker_failure"),
        ([rule(field="onCauses", values=["scale"])], "is no cause"),
        ([rule(field="onCauses", values=[1])], "1 is no cause"),
    ],
)  # fmt: skip
def test_malformed_rules_are_refused_naming_the_field(doc: Any, message: str) -> None:
    with pytest.raises(FailurePolicyError) as err:
        parse_rules(doc)
    assert message in str(err.value)
    assert "[" in str(err.value) or "rules" in str(err.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not JSON"),
        ("[" * 100_000, "longer than"),
        ("9" * 5000, "not JSON"),  # past Python's int digits limit
        ('"FailJob"', "rules must be a list"),
        ("null", "rules must be a list"),
        ("x" * (MAX_WIRE_CHARS + 1), "longer than"),
    ],
)  # fmt: skip
def test_a_hostile_wire_form_is_refused_clearly(text: str, message: str) -> None:
    with pytest.raises(FailurePolicyError, match=message):
        decode_rules(text)


def test_a_deeply_nested_document_is_refused_not_a_crash() -> None:
    text = "[" * 20_000 + "]" * 20_000
    assert len(text) <= MAX_WIRE_CHARS
    with pytest.raises(FailurePolicyError):
        decode_rules(text)


@given(st.text(max_size=300))
def test_decoding_any_text_raises_only_the_policy_error(text: str) -> None:
    with contextlib.suppress(FailurePolicyError):
        decode_rules(text)


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.sampled_from(["action", "onExitCodes", "onSignals",
                                      "onCauses", "operator", "values", "x"]), inner, max_size=4),
                    max_leaves=20))  # fmt: skip
def test_parsing_any_document_raises_only_the_policy_error(doc: Any) -> None:
    try:
        rules = parse_rules(doc)
    except FailurePolicyError:
        return
    assert decode_rules(encode_rules(rules)) == rules  # what is accepted round-trips


def test_the_causes_a_rule_names_are_the_failures() -> None:
    assert [str(c) for c in RULE_CAUSES] == ["worker_failure", "hang", "node_lost",
                                            "start_failure", "oom"]  # fmt: skip
    assert json.loads(encode_rules(parse_rules([rule()]))) == [rule()]
