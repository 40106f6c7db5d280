"""The sidecar's side of spec.failurePolicy: the verdict on a failed round (first rule, or
today's default), the closed reason's root cause naming the rule, and the config that
refuses a malformed $KELASTIC_FAILURE_POLICY."""

from __future__ import annotations

import pytest

from kelastic import contract
from kelastic.failure_policy import ENV_FAILURE_POLICY, FailureAction, parse_rules
from kelastic_sidecar.config import ConfigError, SidecarConfig
from kelastic_sidecar.failure import Failure
from kelastic_sidecar.failure_rules import (
    POD_RESTART_DEPARTURE,
    Verdict,
    in_process_allowed,
    verdict,
)
from kelastic_sidecar.round_end import PLANNED_DEPARTURES, closed_outcome

from .test_sidecar_config import GOOD

RULES = parse_rules([
    {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [42]}},
    {"action": "Ignore", "onCauses": {"operator": "In", "values": ["node_lost"]}},
    {"action": "RestartPod", "onSignals": {"operator": "In", "values": [9]}},
    {"action": "Count", "onCauses": {"operator": "In", "values": ["start_failure"]}},
])  # fmt: skip


def failure(
    cause: str = "worker_failure", code: int | None = None, sig: int | None = None
) -> Failure:
    return Failure(cause=cause, node="j-0", round=2, rank=1, exitcode=code, signal=sig,  # type: ignore[arg-type]
                   message="boom")  # fmt: skip


@pytest.mark.parametrize(
    ("fault", "action", "rule", "ends_when_exhausted", "ends_otherwise"),
    [
        (failure(code=42), FailureAction.FAIL_JOB, "rule 0 (FailJob: exit code 42)", True, True),
        # Ignore: recorded uncharged; only past its cap is it charged, and may end the job
        (failure("node_lost"), FailureAction.IGNORE, "rule 1 (Ignore: cause node_lost)",
         True, False),
        (failure(sig=9), FailureAction.RESTART_POD, "rule 2 (RestartPod: signal SIGKILL)",
         True, True),
        (failure("start_failure", code=127), FailureAction.COUNT,
         "rule 3 (Count: cause start_failure)", True, False),
        (failure(code=1), FailureAction.COUNT, "", True, False),  # no rule: counted
        (failure("hang", sig=15), FailureAction.COUNT, "", True, False),
    ],
)  # fmt: skip
def test_the_first_matching_rule_or_the_default_decides(
    fault: Failure, action: FailureAction, rule: str, ends_when_exhausted: bool,
    ends_otherwise: bool,
) -> None:  # fmt: skip
    v = verdict(RULES, fault)
    assert (v.action, v.rule) == (action, rule)
    assert v.charged == (action in (FailureAction.COUNT, FailureAction.IGNORE))
    assert v.ignored == (action is FailureAction.IGNORE)
    assert (v.ends(True), v.ends(False)) == (ends_when_exhausted, ends_otherwise)


def test_restart_pod_of_another_nodes_failure_is_counted_on_this_node() -> None:
    """A lost node is judged by every survivor: a RestartPod rule matching it replaced
    every surviving Pod (and spent podReplacement once per survivor). Only the failing
    node's own Pod restarts; on the others the failure is counted."""
    lost = parse_rules([{"action": "RestartPod",
                         "onCauses": {"operator": "In", "values": ["node_lost"]}}])  # fmt: skip
    theirs = verdict(lost, failure("node_lost"), node="j-1")
    assert theirs.action is FailureAction.COUNT and theirs.charged
    assert theirs.rule == "rule 0 (RestartPod: cause node_lost)"
    assert verdict(lost, failure("node_lost"), node="j-0").action is FailureAction.RESTART_POD
    assert verdict(lost, failure("node_lost")).action is FailureAction.RESTART_POD  # no node


@pytest.mark.parametrize(
    ("fault", "allowed"),
    [(failure(code=42), False), (failure(sig=9), False),  # FailJob, RestartPod: no respawn
     (failure("node_lost"), True), (failure(code=1), True), (failure("hang", sig=9), False)],
)  # fmt: skip
def test_only_a_restarting_rule_lets_the_hybrid_rung_respawn_a_worker(
    fault: Failure, allowed: bool
) -> None:
    assert in_process_allowed(RULES, fault) is allowed
    assert in_process_allowed((), fault)  # no rules: every death may be taken in process


def test_without_rules_a_start_failure_still_fails_the_job_at_once() -> None:
    v = verdict((), failure("start_failure", code=127))
    assert v == Verdict(FailureAction.FAIL_JOB) and v.ends(False) and not v.charged
    assert v.close_reason(3) == ("not_retried", True)
    assert verdict((), failure(code=1)).close_reason(3) == ("max_restarts", 3)


def test_the_root_cause_names_the_rule_that_failed_the_job() -> None:
    fault = failure(code=42)
    v = verdict(RULES, fault)
    key, value = v.close_reason(3)
    assert (key, value) == ("failure_rule", "rule 0 (FailJob: exit code 42)")
    got, text = closed_outcome({**fault.as_dict(), key: value}, 3)
    assert got == fault
    assert text.startswith(f"{contract.JOB_FAILED_PREFIX}: spec.failurePolicy rule 0 "
                           "(FailJob: exit code 42) applies; root cause: worker_failure: "
                           "rank 1 on j-0 (round 2) exited with code 42: boom")  # fmt: skip
    assert "budget spent" not in text
    assert v.why(3) == "spec.failurePolicy rule 0 (FailJob: exit code 42) applies"


def test_restart_pod_is_no_job_failure_and_its_peers_are_not_charged() -> None:
    v = verdict(RULES, failure(sig=9))
    assert not v.pod_summary(failure(sig=9)).startswith(contract.JOB_FAILED_PREFIX)
    assert "rule 2 (RestartPod: signal SIGKILL)" in v.pod_summary(failure(sig=9))
    assert POD_RESTART_DEPARTURE in PLANNED_DEPARTURES  # the peers re-form as on a scale


def test_the_config_reads_the_rules_and_refuses_malformed_ones() -> None:
    wire = '[{"action":"Ignore","onSignals":{"operator":"In","values":[9]}}]'
    cfg = SidecarConfig.from_env({**GOOD, ENV_FAILURE_POLICY: wire})
    assert cfg.failure_rules == parse_rules([{"action": "Ignore", "onSignals": {
        "operator": "In", "values": [9]}}])  # fmt: skip
    assert SidecarConfig.from_env(GOOD).failure_rules == ()
    for bad, words in (("[{", "not JSON"), ('[{"action":"Nope","onCauses":{}}]', "is no action"),
                       ("1" * 70_000, "longer than")):  # fmt: skip
        with pytest.raises(ConfigError) as err:
            SidecarConfig.from_env({**GOOD, ENV_FAILURE_POLICY: bad})
        assert f"{ENV_FAILURE_POLICY}: " in str(err.value) and words in str(err.value)


def test_an_oom_rule_fails_the_job_before_a_signal_rule_sees_the_sigkill() -> None:
    """An OOM kill is a SIGKILL too: an ``onCauses: [oom]`` FailJob rule put first keeps a
    batch that does not fit from spending the budget, while other SIGKILLs go on to the
    signal rule."""
    rules = parse_rules([
        {"action": "FailJob", "onCauses": {"operator": "In", "values": ["oom"]}},
        {"action": "RestartPod", "onSignals": {"operator": "In", "values": [9]}},
    ])  # fmt: skip
    oom = verdict(rules, failure("oom", sig=9))
    assert (oom.action, oom.rule) == (FailureAction.FAIL_JOB, "rule 0 (FailJob: cause oom)")
    assert verdict(rules, failure(sig=9)).action is FailureAction.RESTART_POD
    assert verdict((), failure("oom", sig=9)).action is FailureAction.COUNT  # no rule: counted
