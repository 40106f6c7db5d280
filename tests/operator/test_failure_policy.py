"""spec.failurePolicy in the operator: the model refuses what the codec refuses, the
Pods' sidecars get the rules by the codec's wire form, and the real API server refuses a
malformed rule with a clear message (schema enums, bounds, list-type set, CEL)."""

from __future__ import annotations

import hashlib
import json
import typing
from typing import Any

import pytest
import yaml

from kelastic import failure_policy
from kelastic_operator.model import CheckpointSpec, ManifestError, RuleCause, parse_job
from kelastic_operator.pods import build_pod, pod_spec_hash
from kelastic_sidecar.config import SidecarConfig
from tests.k8s.cluster import Client

from .conftest import DIGITS
from .test_pods import SETTINGS, UID, digits_spec

FAIL_42 = {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [42]}}


def manifest(**spec: Any) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(DIGITS.read_text())
    doc["spec"].update(spec)
    return doc


def with_rules(*rules: Any) -> dict[str, Any]:
    return manifest(failurePolicy={"rules": list(rules)})


def test_the_models_causes_are_the_codecs() -> None:
    assert list(typing.get_args(RuleCause)) == [str(c) for c in failure_policy.RULE_CAUSES]


def test_a_policy_reads_as_the_sidecar_reads_it() -> None:
    rules = [FAIL_42, {"action": "Ignore", "onCauses": {"operator": "In", "values": ["node_lost"]}},
             {"action": "RestartPod",
              "onSignals": {"operator": "NotIn", "values": [15]}}]  # fmt: skip
    spec = parse_job(with_rules(*rules)).spec
    assert spec.failure_policy is not None
    assert spec.failure_policy.to_rules() == failure_policy.parse_rules(rules)
    pod = build_pod("digits", "default", UID, spec, 0, SETTINGS)
    (sidecar,) = [c for c in pod["spec"]["initContainers"] if c["name"] == "kelastic-sidecar"]
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    wire = env[failure_policy.ENV_FAILURE_POLICY]
    assert json.loads(wire) == rules
    assert failure_policy.decode_rules(wire) == spec.failure_policy.to_rules()
    # and the sidecar's config takes it (the env of a Pod, fieldRefs filled in)
    filled = {k: v or "x" for k, v in env.items() if k.startswith("KELASTIC_")}
    filled["KELASTIC_POD_IP"] = "10.0.0.1"
    assert SidecarConfig.from_env(filled).failure_rules == spec.failure_policy.to_rules()


def test_without_a_policy_no_env_and_the_pods_digest_of_older_jobs() -> None:
    spec = digits_spec(checkpoint=CheckpointSpec())  # the example's own volume unset
    pod = build_pod("digits", "default", UID, spec, 0, SETTINGS)
    names = [e["name"] for c in pod["spec"]["initContainers"] for e in c.get("env", [])]
    assert failure_policy.ENV_FAILURE_POLICY not in names
    # the digest an operator without failurePolicy / ttlSecondsAfterFinished / checkpoint /
    # suspend / nodeLostSeconds / stragglers computed: the new fields unset must not
    # replace the Pods of running jobs on an upgrade
    older = spec.model_dump(mode="json", by_alias=True, exclude={
        "replicas", "pending_timeout_seconds", "start_timeout_seconds", "cleanup_policy",
        "pod_replacement", "in_process", "failure_policy",
        "ttl_seconds_after_finished", "checkpoint", "suspend", "node_lost_seconds",
        "stragglers"})  # fmt: skip
    text = json.dumps(older, sort_keys=True, separators=(",", ":"))
    assert pod_spec_hash(spec) == hashlib.sha256(text.encode()).hexdigest()[:16]
    assert pod_spec_hash(spec.model_copy(update={"ttl_seconds_after_finished": 60})) == (
        pod_spec_hash(spec)
    )
    # suspend neither: a resumed job's Pods are not outdated by the flag flipping back
    assert pod_spec_hash(spec.model_copy(update={"suspend": True})) == pod_spec_hash(spec)
    ruled = parse_job(with_rules(FAIL_42)).spec
    assert pod_spec_hash(ruled) != pod_spec_hash(spec)  # rules shape the sidecar's env


#: (rules, words of the model's refusal, words of the API server's refusal)
BAD: list[tuple[Any, str, str]] = [
    ([], "at least 1 item", "spec.failurePolicy.rules"),
    ([FAIL_42] * 21, "at most 20 items", "spec.failurePolicy.rules"),
    ([{"action": "Retry", "onExitCodes": {"operator": "In", "values": [1]}}],
     "action", 'Unsupported value: "Retry"'),
    ([{"action": "FailJob"}], "exactly one of onExitCodes, onSignals, onCauses",
     "a rule must have exactly one of onExitCodes, onSignals, onCauses"),
    ([{**FAIL_42, "onCauses": {"operator": "In", "values": ["hang"]}}],
     "exactly one of", "a rule must have exactly one of"),
    ([{"action": "FailJob", "onExitCodes": {"operator": "In", "values": []}}],
     "at least 1 item", "spec.failurePolicy.rules[0].onExitCodes.values"),
    ([{"action": "FailJob", "onExitCodes": {"operator": "Is", "values": [1]}}],
     "operator", 'Unsupported value: "Is"'),
    ([{"action": "FailJob", "onExitCodes": {"operator": "In", "values": [10**30]}}],
     "less than or equal to 255", "spec.failurePolicy.rules[0].onExitCodes.values[0]"),
    ([{"action": "FailJob", "onExitCodes": {"operator": "In", "values": [-1]}}],
     "greater than or equal to 0", "spec.failurePolicy.rules[0].onExitCodes.values[0]"),
    ([{"action": "FailJob", "onExitCodes": {"operator": "In", "values": ["42"]}}],
     "valid integer", "spec.failurePolicy.rules[0].onExitCodes.values[0]"),
    ([{"action": "FailJob", "onExitCodes": {"operator": "In", "values": [0]}}],
     "exit code 0 is no failure; In may not list it", "exit code 0 is no failure"),
    ([{"action": "FailJob", "onExitCodes": {"operator": "In", "values": [3, 3]}}],
     "lists a value twice", "Duplicate value: 3"),
    ([{"action": "Ignore", "onSignals": {"operator": "In", "values": [65]}}],
     "less than or equal to 64", "spec.failurePolicy.rules[0].onSignals.values[0]"),
    ([{"action": "Ignore", "onCauses": {"operator": "In", "values": ["scale"]}}],
     "onCauses.values.0", 'Unsupported value: "scale"'),
    ([{**FAIL_42, "onOOM": True}], "onOOM", "onOOM"),
]  # fmt: skip


@pytest.mark.parametrize(("rules", "model_words", "_api"), BAD)
def test_the_model_refuses_a_malformed_rule(rules: Any, model_words: str, _api: str) -> None:
    with pytest.raises(ManifestError) as err:
        parse_job(with_rules(*rules))
    assert "spec.failurePolicy" in str(err.value) and model_words in str(err.value), err.value


@pytest.mark.parametrize(("rules", "_model", "api_words"), BAD)
def test_the_api_server_refuses_a_malformed_rule(
    k8s: Client, rules: Any, _model: str, api_words: str
) -> None:
    result = k8s.kubectl("apply", "-f", "-", input=yaml.safe_dump(with_rules(*rules)),
                         check=False)  # fmt: skip
    assert result.returncode != 0
    assert api_words in result.stderr, result.stderr
    assert not k8s.objects("elasticjobs")


def test_the_api_server_stores_a_policy_the_model_reads_back(k8s: Client) -> None:
    rules = [FAIL_42, {"action": "Count", "onExitCodes": {"operator": "NotIn", "values": [0]}},
             {"action": "Ignore", "onCauses": {"operator": "In", "values": ["node_lost", "hang"]}},
             {"action": "RestartPod", "onSignals": {"operator": "In", "values": [9]}}]  # fmt: skip
    k8s.kubectl("apply", "-f", "-", input=yaml.safe_dump(with_rules(*rules)))
    stored = k8s.get("elasticjob", "digits")
    assert stored is not None and stored["spec"]["failurePolicy"] == {"rules": rules}
    spec = parse_job(stored).spec
    assert spec.failure_policy is not None
    assert spec.failure_policy.to_rules() == failure_policy.parse_rules(rules)
    out = " ".join(k8s.kubectl("explain", "ej.spec.failurePolicy.rules.action").stdout.split())
    assert "FailJob: fail the job at once" in out and "`" not in out
