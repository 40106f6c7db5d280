"""The ElasticJob resource as a pydantic model: the single source of truth for its spec.

``kelastic run`` (local mode) and the operator read manifests through
:func:`load_manifest`; the CRD schema is generated from these classes.
Field names are the camelCase of the Kubernetes resource.

Over ~400 lines because it is the whole ElasticJob resource in one place, the CRD's single
source: spec and status models with their descriptions (the CRD and ``kubectl explain``
text), the CEL rules that mirror the validators, and the manifest loaders; splitting it
would scatter one schema across modules that change together.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Final, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    StringConstraints,
    ValidationError,
    model_validator,
)

from kelastic import contract, failure_policy, preflight
from kelastic.checkpoint.volume import QUANTITY_PATTERN, parse_quantity
from kelastic.netcheck import Floors, Setting

API_GROUP = "kelastic.dev"
API_VERSION = "v1alpha1"
KIND = "ElasticJob"
TRAINER_CONTAINER = "trainer"
#: An ElasticJob's name: a DNS label short enough that ``<name>-<index>`` Pod names and the
#: label values holding them stay within 63 characters.
NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
MAX_NAME_LENGTH = 52
#: Upper bound of ``spec.ttlSecondsAfterFinished``: an int32, as batch/v1 Job's field.
MAX_TTL_SECONDS = 2**31 - 1
#: Default of ``spec.nodeLostSeconds``: the control plane calls a Node not Ready after its
#: kubelet missed ~50 s of heartbeats (node-monitor-grace-period); a minute more rides out
#: a control-plane blip without leaving a dead Node's Pods Terminating for 5 minutes
#: (the default eviction toleration) or for good (the Pods of an unreachable Node).
DEFAULT_NODE_LOST_SECONDS = 60.0


class ManifestError(ValueError):
    """A manifest could not be read or does not describe a valid ElasticJob.

    The message names the file and every offending field, one per line.
    """


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class RendezvousSpec(_Model):
    """Where and how the job's nodes meet (``spec.rendezvous``)."""

    etcd_endpoints: list[str] = Field(
        default_factory=list,
        alias="etcdEndpoints",
        description="host:port of etcd; empty = the operator's default (local mode: embedded)",
    )
    tls_secret: str | None = Field(
        default=None, alias="tlsSecret", description="Secret with ca.crt, tls.crt, tls.key"
    )
    auth_secret: str | None = Field(
        default=None,
        alias="authSecret",
        description="Secret (type kubernetes.io/basic-auth: keys username and password) "
        "with the etcd user the sidecars authenticate as, for an etcd with auth enabled; "
        "beside or without tlsSecret",
    )
    join_timeout_seconds: float = Field(
        default=contract.DEFAULT_JOIN_TIMEOUT,
        gt=0,
        alias="joinTimeoutSeconds",
        description="seconds a node waits to join a rendezvous round before failing",
    )
    last_call_timeout_seconds: float = Field(
        default=contract.DEFAULT_LAST_CALL_TIMEOUT,
        gt=0,
        alias="lastCallTimeoutSeconds",
        description="seconds a round stays open for more nodes once minReplicas have joined",
    )
    lease_ttl_seconds: int = Field(
        default=contract.DEFAULT_LEASE_TTL,
        ge=1,
        le=300,
        alias="leaseTTLSeconds",
        description="seconds (integer) a node stays alive in etcd without a keep-alive",
    )


class WarmStartSpec(_Model):
    """Warm start of the workers (``spec.warmStart``): see ``kelastic.launch --warm-start``.

    The launcher forks every worker of every attempt from one process that imported
    ``preload`` while the node joined the rendezvous, so a restart skips the
    interpreter start and ``import torch``. The trainer's command must be ``python
    [-u] [-B] script|-m module|-c code ...``; other commands start cold (logged).
    """

    enabled: bool = Field(default=False, description="fork workers from a preloaded zygote")
    preload: list[Annotated[str, StringConstraints(pattern=contract.MODULE_NAME_PATTERN)]] = Field(
        default_factory=lambda: list(contract.DEFAULT_PRELOAD),
        max_length=256,
        description="modules the zygote imports before forking workers",
        json_schema_extra={"default": list(contract.DEFAULT_PRELOAD)},
    )


#: A volume's name in a Pod (an RFC 1123 label).
VOLUME_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
#: A relative folder in a volume: names of letters, digits and ``._-``, none starting
#: with a dot (so no ``.`` or ``..``), 255 characters at most. RE2, as the API server
#: checks it (which refuses a repeat count over 1000, a nested ``{0,254}`` included).
RELATIVE_PATH_PATTERN = r"^[A-Za-z0-9_-][A-Za-z0-9._-]*(/[A-Za-z0-9_-][A-Za-z0-9._-]*)*$"


class CheckpointPersistSpec(_Model):
    """Persistence of the in-memory checkpoints (``spec.checkpoint.persist``): the sidecars
    write committed steps to a volume every Pod shares, in torch DCP's format
    (``<volume>/<path>/step-<S>/rank-<R>``, loadable with ``torch.distributed.checkpoint``
    without kelastic; ``step-<S>/COMPLETE`` once every rank is there)."""

    volume: Annotated[str, StringConstraints(pattern=VOLUME_NAME_PATTERN)] = Field(
        description="a volume of the Pod template every Pod shares (a ReadWriteMany claim); "
        f"the sidecar mounts it at {contract.PERSIST_MOUNT}",
    )
    path: Annotated[str, StringConstraints(pattern=RELATIVE_PATH_PATTERN, max_length=255)] = Field(
        default="kelastic-checkpoints",
        description="the folder in the volume: relative, names not starting with a dot",
    )
    every_steps: int = Field(
        default=0, ge=0, le=contract.MAX_PERSIST_EVERY, alias="everySteps",
        description="persist each step that is a multiple of this; 0: only when a Pod stops",
    )  # fmt: skip
    on_stop: bool = Field(
        default=True, alias="onStop",
        description="when a Pod is stopped (deletion, drain, preemption, scale-down), persist "
        "what its checkpoint slots hold",
    )  # fmt: skip
    keep: int = Field(
        default=contract.DEFAULT_PERSIST_KEEP, ge=1, le=contract.MAX_PERSIST_KEEP,
        description="complete steps kept; older ones are removed",
    )  # fmt: skip


#: CEL rule of ``spec.checkpoint``: :meth:`CheckpointSpec._check`, worded alike.
CHECKPOINT_CEL_RULES: list[JsonValue] = [
    {
        "rule": "!has(self.persist) || has(self.memory)",
        "message": "checkpoint.persist needs checkpoint.memory: it persists the slots",
    },
    {
        "rule": "!has(self.replicas) || self.replicas == 0 || has(self.memory)",
        "message": "checkpoint.replicas needs checkpoint.memory: it replicates the slots",
    },
]


class CheckpointSpec(_Model):
    """In-memory checkpoints (``spec.checkpoint``; ``kelastic.checkpoint`` in the trainer).

    With ``memory`` set every Pod gets a memory-backed volume of that size
    (``emptyDir`` with ``medium: Memory`` and ``sizeLimit``) at
    ``/var/run/kelastic-checkpoints`` in the trainer and the sidecar; the sidecar
    allocates it in full at its start (a volume too small fails then, naming the size
    needed) and agrees with its peers on the step to restore. Its pages count against
    the memory of the container that writes them (the trainer's slots): give the
    trainer's memory limit room for it. Three slots per rank: about three times a rank's
    state times the ranks per node.
    """

    model_config = ConfigDict(
        extra="forbid",
        populate_by_name=True,
        json_schema_extra={"x-kubernetes-validations": CHECKPOINT_CEL_RULES},
    )

    memory: Annotated[str, StringConstraints(pattern=QUANTITY_PATTERN)] | None = Field(
        default=None,
        description="size of each Pod's checkpoint volume (emptyDir medium Memory "
        "sizeLimit), e.g. 512Mi: a positive integer with an optional suffix Ki, Mi, Gi, Ti, k, M, "
        "G or T",
    )

    persist: CheckpointPersistSpec | None = Field(
        default=None,
        description="write committed steps to a shared volume in torch DCP's format (needs memory)",
    )

    replicas: int = Field(
        default=0, ge=0, le=contract.MAX_CHECKPOINT_REPLICAS,
        description="peer nodes that hold a replica of each rank's steps, every "
        "replicateEverySteps (needs memory): after a node is lost its ranks restore from the "
        "peer, not from disk. Snapshots and replicas share the checkpoint volume: size memory "
        "for about seven times a rank's state per rank (three slots, two snapshots, two "
        "replicas of the peer's). 0: none",
    )  # fmt: skip

    replicate_every_steps: int = Field(
        default=contract.DEFAULT_REPLICATE_EVERY, ge=1, le=contract.MAX_PERSIST_EVERY,
        alias="replicateEverySteps",
        description="replicate the steps that are multiples of this (every node the same "
        "steps): a node loss costs at most about this many steps plus the replication's lag",
    )  # fmt: skip

    replication_rate: Annotated[str, StringConstraints(pattern=QUANTITY_PATTERN)] | None = Field(
        default=None, alias="replicationRate",
        description="bytes per second each sidecar sends replicas at, at most (default 512Mi, "
        "about 4.3 Gbit/s), so that the training's own traffic keeps the Pod network; a "
        "quantity as memory's",
    )  # fmt: skip

    state_layout: Literal["Sharded", "Replicated"] = Field(
        default="Sharded", alias="stateLayout",
        description="how the ranks' saved states relate. Sharded: each rank saves its own "
        "part (any parallelism) and restores its own rank's, so ranks new to a grown world "
        "have none (the job restores nothing). Replicated: every rank saves the same state "
        "(DDP), so any rank's copy restores any rank: a grown or renumbered world restores "
        "from the node's slots, from a peer's (each sidecar serves its slots then) or from "
        "a step persisted by any world",
    )  # fmt: skip

    @property
    def replicated(self) -> bool:
        """Whether ``stateLayout`` is ``Replicated``."""
        return self.state_layout == "Replicated"

    @property
    def serves_slots(self) -> bool:
        """Whether each sidecar serves its slots to the job's others: with replicas, or a
        replicated state with a volume (a joining node fetches its step)."""
        return bool(self.replicas) or (self.replicated and self.memory is not None)

    @property
    def memory_bytes(self) -> int | None:
        """``memory`` in bytes (None when unset)."""
        return parse_quantity(self.memory) if self.memory is not None else None

    @property
    def replication_bytes_per_second(self) -> int:
        """``replicationRate`` in bytes per second (the default when unset)."""
        if self.replication_rate is None:
            return contract.DEFAULT_REPLICATION_RATE
        return parse_quantity(self.replication_rate)

    @model_validator(mode="after")
    def _check(self) -> CheckpointSpec:
        if self.persist is not None and self.memory is None:
            raise ValueError("checkpoint.persist needs checkpoint.memory: it persists the slots")
        if self.replicas and self.memory is None:
            raise ValueError("checkpoint.replicas needs checkpoint.memory: it replicates the slots")
        return self


#: CEL rule of ``spec.inProcess``: :meth:`InProcessSpec._check`, worded alike (the API
#: server applies the defaults before it validates, so both fields are there).
INPROCESS_CEL_RULES: list[JsonValue] = [
    {
        "rule": "!has(self.softTimeoutSeconds) || !has(self.hardTimeoutSeconds) || "
        "self.hardTimeoutSeconds > self.softTimeoutSeconds",
        "message": "hardTimeoutSeconds must be greater than softTimeoutSeconds",
    }
]


class InProcessSpec(_Model):
    """In-process restart (``spec.inProcess``): the first rung of recovery.

    With ``enabled``, a fault inside the training function wrapped by
    ``kelastic.inprocess.Wrapper`` (an exception, or no progress for
    ``softTimeoutSeconds``) restarts only that function on every rank: the worker
    processes, their imports and the CUDA context stay. ``maxRestarts`` such restarts are
    spent before a fault restarts the worker processes (the job's ``maxRestarts``, the
    next rung). A rank that has not left the function ``hardTimeoutSeconds`` after the
    abort was asked is killed, which is a process restart. A worker process that dies
    is replaced by one of the node's ``spareRanks`` waiting spares, or else started again,
    while its peers restart in process. A training script that does not use the Wrapper
    is unaffected.
    """

    model_config = ConfigDict(
        extra="forbid",
        populate_by_name=True,
        json_schema_extra={"x-kubernetes-validations": INPROCESS_CEL_RULES},
    )

    enabled: bool = Field(
        default=False,
        description="restart the wrapped training function in the running worker processes "
        "before restarting the processes",
    )
    max_restarts: int = Field(
        default=contract.DEFAULT_INPROCESS_MAX_RESTARTS,
        ge=0,
        le=1_000_000,
        alias="maxRestarts",
        description="in-process restarts the job may spend before a fault restarts the worker "
        "processes (counted apart from spec.maxRestarts)",
    )
    soft_timeout_seconds: float = Field(
        default=contract.DEFAULT_INPROCESS_SOFT_TIMEOUT,
        gt=0,
        le=86400,
        alias="softTimeoutSeconds",
        description="seconds a rank may go without progress (a ping, or an expires() acquire) "
        "before every rank is asked to abort the iteration",
    )
    hard_timeout_seconds: float = Field(
        default=contract.DEFAULT_INPROCESS_HARD_TIMEOUT,
        gt=0,
        le=86400,
        alias="hardTimeoutSeconds",
        description="seconds after an abort was asked before a rank that has not left the "
        "function is killed (a process restart); must be greater than softTimeoutSeconds",
    )
    spare_ranks: int = Field(
        default=0,
        ge=0,
        le=contract.MAX_INPROCESS_SPARES,
        alias="spareRanks",
        description="spare worker processes per node: each runs the script up to the "
        "wrapped function and waits there, warm; when a worker process dies, a spare takes "
        "its rank in the in-process restart of its peers (no process start) and a new "
        "spare starts in the background",
    )

    @model_validator(mode="after")
    def _check(self) -> InProcessSpec:
        if self.hard_timeout_seconds <= self.soft_timeout_seconds:
            raise ValueError(
                f"hardTimeoutSeconds ({self.hard_timeout_seconds:g}) must be greater than "
                f"softTimeoutSeconds ({self.soft_timeout_seconds:g})"
            )
        return self


class PodReplacementSpec(_Model):
    """How the operator replaces failed Pods (``spec.podReplacement``)."""

    max_replacements: int = Field(
        default=10,
        ge=0,
        alias="maxReplacements",
        description="failed Pods the operator replaces before it fails the job",
    )
    backoff_seconds: float = Field(
        default=10.0,
        ge=0,
        alias="backoffSeconds",
        description="seconds before the first replacement; doubles with each replacement",
    )
    max_backoff_seconds: float = Field(
        default=300.0,
        ge=0,
        alias="maxBackoffSeconds",
        description="upper bound of the replacement backoff, seconds",
    )


#: CEL rules of one failure rule (``spec.failurePolicy.rules[i]``): what
#: :func:`kelastic.failure_policy.parse_rules` checks beyond the schema, worded alike.
FAILURE_RULE_CEL_RULES: list[JsonValue] = [
    {
        "rule": "(has(self.onExitCodes) ? 1 : 0) + (has(self.onSignals) ? 1 : 0) + "
        "(has(self.onCauses) ? 1 : 0) == 1",
        "message": "a rule must have exactly one of onExitCodes, onSignals, onCauses",
    }
]
EXIT_CODES_CEL_RULES: list[JsonValue] = [
    {
        "rule": "self.operator == 'NotIn' || !self.values.exists(v, v == 0)",
        "message": "exit code 0 is no failure; In may not list it",
    }
]
#: The causes a rule may name: :data:`kelastic.failure_policy.RULE_CAUSES` (a test
#: checks they agree).
RuleCause = Literal["worker_failure", "hang", "node_lost", "start_failure", "oom"]
_SET: dict[str, JsonValue] = {"x-kubernetes-list-type": "set"}


class ExitCodesMatch(_Model):
    """``onExitCodes`` of a failure rule: the failed worker's exit code."""

    model_config = ConfigDict(
        extra="forbid",
        populate_by_name=True,
        json_schema_extra={"x-kubernetes-validations": EXIT_CODES_CEL_RULES},
    )
    operator: Literal["In", "NotIn"] = Field(
        description="In: the exit code is one of values; NotIn: the worker exited with a "
        "code that is not (a worker killed by a signal has none)"
    )
    values: list[Annotated[int, Field(ge=0, le=255, strict=True)]] = Field(
        min_length=1,
        max_length=failure_policy.MAX_VALUES,
        description="exit codes, 0..255 (0 only with NotIn), each once",
        json_schema_extra=_SET,
    )


class SignalsMatch(_Model):
    """``onSignals`` of a failure rule: the signal that killed the failed worker."""

    operator: Literal["In", "NotIn"] = Field(
        description="In: the signal is one of values; NotIn: the worker was killed by a "
        "signal that is not (a hung worker reaped by the timer server is a SIGKILL)"
    )
    values: list[Annotated[int, Field(ge=1, le=64, strict=True)]] = Field(
        min_length=1,
        max_length=failure_policy.MAX_VALUES,
        description="signal numbers, 1..64 (e.g. 9 for SIGKILL), each once",
        json_schema_extra=_SET,
    )


class CausesMatch(_Model):
    """``onCauses`` of a failure rule: kelastic's cause of the failure."""

    operator: Literal["In", "NotIn"] = Field(
        description="In: the failure's cause is one of values; NotIn: it is not"
    )
    values: list[RuleCause] = Field(
        min_length=1,
        max_length=len(failure_policy.RULE_CAUSES),
        description="causes: worker_failure (a worker exited non-zero or was killed), hang "
        "(reaped by the timer server), node_lost (a peer's lease expired), start_failure "
        "(a worker could not be started: exit 126/127, exec failed), oom (the kernel's OOM "
        "killer took a worker)",
        json_schema_extra=_SET,
    )


class FailureRuleSpec(_Model):
    """One failure rule: the action for the failures it matches (exactly one of
    onExitCodes, onSignals, onCauses)."""

    model_config = ConfigDict(
        extra="forbid",
        populate_by_name=True,
        json_schema_extra={"x-kubernetes-validations": FAILURE_RULE_CEL_RULES},
    )
    action: Literal["FailJob", "Ignore", "Count", "RestartPod"] = Field(
        description="FailJob: fail the job at once; Ignore: restart without charging "
        "maxRestarts; Count: charge maxRestarts (the behaviour without rules); "
        "RestartPod: the failing node's Pod fails and is replaced (podReplacement's budget)"
    )
    on_exit_codes: ExitCodesMatch | None = Field(
        default=None, alias="onExitCodes", description="match the failed worker's exit code"
    )
    on_signals: SignalsMatch | None = Field(
        default=None, alias="onSignals", description="match the signal that killed the worker"
    )
    on_causes: CausesMatch | None = Field(
        default=None, alias="onCauses", description="match kelastic's cause of the failure"
    )


class NetworkCheckSpec(_Model):
    """``spec.preflight.network``: the built-in network check of each round
    (:mod:`kelastic.netcheck`): after the round's rendezvous, before its workers start,
    the round's nodes run a gloo all-reduce of ``sizeMiB`` together (one process per node,
    in the trainer container); when it misses a floor, pair tests name the nodes at
    fault, which leave (their Pods fail and are replaced, their Nodes avoided) while the
    round forms again without them. Defaults catch a broken node, not a slow fabric: set
    the floors to your network's."""

    max_latency_milliseconds: float = Field(
        default=50.0,
        gt=0,
        le=60_000,
        alias="maxLatencyMilliseconds",
        description="most milliseconds a 4-byte all-reduce of the round's nodes may take "
        "(median of `iterations`)",
    )
    min_bandwidth_mbps: float = Field(
        default=50.0,
        gt=0,
        le=10_000_000,
        alias="minBandwidthMBps",
        description="least bandwidth of the all-reduce of sizeMiB, in MB/s (10^6 bytes a "
        "second: payload bytes over the median time)",
    )
    size_mib: int = Field(
        default=4, ge=1, le=256, alias="sizeMiB", description="MiB each node all-reduces"
    )
    iterations: int = Field(
        default=5, ge=1, le=100, description="timed all-reduces of each kind (their median)"
    )
    timeout_seconds: int = Field(
        default=30,
        ge=1,
        le=600,
        alias="timeoutSeconds",
        description="seconds each step may take (the group's forming, the all-reduce, each "
        "pass of pair tests); a check that runs out is inconclusive: the workers start",
    )

    def to_setting(self) -> Setting:
        """The setting as the sidecar and the launcher read it (:mod:`kelastic.netcheck`).

        Raises:
            kelastic.netcheck.NetcheckError: a value the codec refuses.
        """
        floors = Floors(
            max_latency_s=self.max_latency_milliseconds / 1000.0,
            min_bandwidth_bps=self.min_bandwidth_mbps * 1e6,
            size_bytes=self.size_mib * 2**20,
            iterations=self.iterations,
        )
        return Setting(floors, float(self.timeout_seconds))


#: CEL rule of ``spec.preflight``: what :meth:`PreflightSpec._check` refuses.
PREFLIGHT_CEL_RULES: list[JsonValue] = [
    {"rule": "has(self.command) || has(self.network)",
     "message": "spec.preflight needs a command, a network check, or both"},
]  # fmt: skip


class PreflightSpec(_Model):
    """``spec.preflight``: checks a Pod's node passes before its workers join a round: the
    user's ``command`` (:mod:`kelastic.preflight`: the launcher runs it once per Pod in the
    trainer container, where the GPUs are; a node that fails it never joins, its Pod fails
    and is replaced) and the built-in ``network`` check of each round. At least one."""

    command: (
        list[Annotated[str, StringConstraints(min_length=1, max_length=preflight.MAX_ARG_CHARS)]]
        | None
    ) = Field(
        default=None,
        min_length=1,
        max_length=preflight.MAX_ARGS,
        description="the check's program and arguments (no shell), run with the trainer's "
        "image and environment once per Pod before it joins; exit 0 passes, e.g. "
        "[nvidia-smi] or [sh, -c, 'dcgmi diag -r 1']",
    )
    timeout_seconds: int = Field(
        default=60,
        ge=1,
        le=preflight.MAX_TIMEOUT,
        alias="timeoutSeconds",
        description="seconds the command may run; past it, it fails (its processes killed)",
    )
    network: NetworkCheckSpec | None = Field(
        default=None,
        description="the round's nodes' gloo all-reduce against a latency and a bandwidth "
        "floor, before each round's workers start ({} for the defaults)",
    )

    @model_validator(mode="after")
    def _check(self) -> PreflightSpec:
        if self.command is None and self.network is None:
            raise ValueError("spec.preflight needs a command, a network check, or both")
        return self

    def to_preflight(self) -> preflight.Preflight | None:
        """The command as the launcher reads it (:mod:`kelastic.preflight`); None when
        there is none.

        Raises:
            kelastic.preflight.PreflightError: an argument the launcher would refuse.
        """
        if self.command is None:
            return None
        return preflight.Preflight(tuple(self.command), float(self.timeout_seconds))


class StragglersSpec(_Model):
    """``spec.stragglers``: how a straggler is told and what is done with it. The sidecar of
    each node judges its ranks' step times (the ``expires()`` scopes, acquire to release):
    a local rank whose median step exceeds ``factor`` times its node's other ranks' median
    over its last ``minSteps`` steps or more is a straggler."""

    action: Literal["Warn", "Replace"] = Field(
        default="Warn",
        description="Warn: the straggler is named in status.stragglers, the Stragglers "
        "condition and a StragglerDetected Event; Replace: also its Pod is replaced (a "
        "departure notice first, so its peers re-form charging nothing) and its Node "
        "quarantined (status.quarantinedNodes): a slow GPU or link stays slow",
    )
    factor: float = Field(
        default=1.5,
        gt=1,
        le=1000,
        description="a rank whose median step time exceeds this many times its node's other "
        "ranks' median is a straggler",
    )
    min_steps: int = Field(
        default=20,
        ge=1,
        le=64,
        alias="minSteps",
        description="steps a rank needs in its window (the last 64) before it is judged",
    )


class FailurePolicySpec(_Model):
    """``spec.failurePolicy``: rules, in the style of batch/v1 Job's ``podFailurePolicy``,
    applied by the sidecar of the node where a failure happens; the first rule that
    matches decides (:mod:`kelastic.failure_policy`). No rule matching: a start failure
    fails the job, any other failure is counted against ``maxRestarts``."""

    rules: list[FailureRuleSpec] = Field(
        min_length=1,
        max_length=failure_policy.MAX_RULES,
        description="the rules, first match wins; the job's Failed condition and the root "
        "cause name the rule that failed it, e.g. rule 0 (FailJob: exit code 42)",
    )

    @model_validator(mode="after")
    def _check(self) -> FailurePolicySpec:
        self.to_rules()  # raises FailurePolicyError (a ValueError) with the codec's words
        return self

    def to_rules(self) -> tuple[failure_policy.FailureRule, ...]:
        """The rules as the sidecar reads them (:func:`kelastic.failure_policy.parse_rules`).

        Raises:
            FailurePolicyError: a rule the codec refuses.
        """
        docs = [r.model_dump(by_alias=True, exclude_none=True) for r in self.rules]
        return failure_policy.parse_rules(docs)


#: CEL rules of ``spec`` in the CRD: the API server rejects what :meth:`ElasticJobSpec._check`
#: rejects before the operator ever sees it. Plain messages: a real API server refuses a
#: ``messageExpression`` here (its estimated cost, with ``template`` of unbounded size in
#: ``self``, exceeds the CRD's CEL budget over 100 times).
SPEC_CEL_RULES: list[JsonValue] = [
    {
        "rule": "!has(self.minReplicas) || !has(self.maxReplicas) || "
        "self.minReplicas <= self.maxReplicas",
        "message": "minReplicas must be <= maxReplicas",
    },
    {
        "rule": "!has(self.minReplicas) || self.minReplicas <= self.replicas",
        "message": "replicas must be >= minReplicas",
    },
    {
        "rule": "!has(self.maxReplicas) || self.replicas <= self.maxReplicas",
        "message": "replicas must be <= maxReplicas",
    },
]


#: CEL rules of ``spec.template.spec``: :func:`trainer_container`'s checks, worded alike.
TEMPLATE_CEL_RULES: list[JsonValue] = [
    {
        "rule": "size(self.containers) == 1 || "
        f"self.containers.exists(c, has(c.name) && c.name == '{TRAINER_CONTAINER}')",
        "message": "template.spec.containers has several containers; name the training one "
        f"'{TRAINER_CONTAINER}'",
    },
    {
        "rule": "self.containers.exists(c, (size(self.containers) == 1 || "
        f"(has(c.name) && c.name == '{TRAINER_CONTAINER}')) && has(c.command) && "
        "size(c.command) > 0)",
        "message": "the trainer container needs a command (a list of strings): the launcher "
        "wraps it",
    },
]


class ElasticJobSpec(_Model):
    """``spec`` of an ElasticJob.

    ``replicas`` nodes (Pods) are wanted; rendezvous admits between ``minReplicas`` and
    ``maxReplicas`` of them, each running ``nprocPerNode`` workers. ``maxRestarts`` is
    the job's global worker-group restart budget (scale events do not spend it).
    """

    model_config = ConfigDict(
        extra="forbid",
        populate_by_name=True,
        json_schema_extra={"x-kubernetes-validations": SPEC_CEL_RULES},
    )

    replicas: int = Field(ge=1, le=10000, description="nodes (Pods) wanted")
    min_replicas: int | None = Field(
        default=None,
        ge=1,
        le=10000,
        alias="minReplicas",
        description="fewest nodes a rendezvous round may start with (default: replicas)",
    )
    max_replicas: int | None = Field(
        default=None,
        ge=1,
        le=10000,
        alias="maxReplicas",
        description="most nodes a rendezvous round admits (default: replicas)",
    )
    nproc_per_node: int = Field(
        default=1, ge=1, le=1024, alias="nprocPerNode", description="worker processes per node"
    )
    max_restarts: int = Field(
        default=contract.DEFAULT_MAX_RESTARTS,
        ge=0,
        alias="maxRestarts",
        description="worker-group restarts the whole job may spend (scale events spend none)",
    )
    pending_timeout_seconds: float = Field(
        default=600.0,
        gt=0,
        alias="pendingTimeoutSeconds",
        description=(
            "seconds a Pod may stay unschedulable (PodScheduled=False, reason "
            "Unschedulable) before the operator shrinks the job towards minReplicas (it "
            "grows back later)"
        ),
    )
    start_timeout_seconds: float = Field(
        default=1800.0,
        gt=0,
        alias="startTimeoutSeconds",
        description=(
            "seconds a scheduled Pod may take to start (image pull, volume mounts) before "
            "it counts as stuck like an unschedulable one"
        ),
    )
    node_lost_seconds: float = Field(
        default=DEFAULT_NODE_LOST_SECONDS,
        gt=0,
        le=86400,
        alias="nodeLostSeconds",
        description=(
            "seconds a Node may stay not Ready (its kubelet stopped heart-beating, or says "
            "it is not ready) before the operator counts its Pods lost: their nodes leave "
            "the rendezvous, the Pods are force-deleted (a Pod on an unreachable Node would "
            "otherwise stay Terminating for good) and replaced elsewhere, charged to no "
            "budget of the operator's (the survivors charge one node_lost restart)"
        ),
    )
    cleanup_policy: Literal["None", "Running", "All"] = Field(
        default="Running",
        alias="cleanupPolicy",
        description="Pods deleted when the job finishes: None (keep them), Running (those "
        "still Pending or Running), All; with ttlSecondsAfterFinished the job and all its "
        "Pods are deleted later in any case",
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None,
        ge=0,
        le=MAX_TTL_SECONDS,
        strict=True,  # an integer, as the CRD says: "60" or true is a mistake, not 60 s
        alias="ttlSecondsAfterFinished",
        description=(
            "seconds after the job finished (Succeeded or Failed: status.completionTime) "
            "before the operator deletes it, as batch/v1 Job's field: its Pods go first, "
            "then its etcd keys, then the job (the deletion a kubectl delete makes); 0 "
            "deletes it as soon as it finishes; unset keeps it until deleted. Until then "
            "cleanupPolicy says which of its Pods are deleted when it finishes"
        ),
    )
    suspend: bool = Field(
        default=False,
        strict=True,  # a boolean, as the CRD says: "true" is a mistake
        description=(
            "as batch/v1 Job's field: true stops the job's Pods (each gets its grace period; "
            "their nodes leave the rendezvous with a departure notice, so no restart is "
            "spent) and creates none while it stays true (status.phase Suspended, condition "
            "Suspended); false again creates them and training continues from the newest "
            "checkpoint. A job created suspended creates no Pod. No effect on a finished job"
        ),
    )
    preflight: PreflightSpec | None = Field(
        default=None,
        description="checks each Pod's node passes before it joins: its program (in the "
        "trainer container, once per Pod) and the round's network check (before each "
        "round's workers start); a node that fails never joins: its Pod fails and is "
        "replaced (podReplacement), its Node avoided, nothing charged to maxRestarts",
        json_schema_extra={"x-kubernetes-validations": PREFLIGHT_CEL_RULES},
    )
    stragglers: StragglersSpec = Field(
        default_factory=StragglersSpec,
        description="stragglers: a rank slower than its node's others (its step times)",
        json_schema_extra={"default": {}},
    )
    failure_policy: FailurePolicySpec | None = Field(
        default=None,
        alias="failurePolicy",
        description="rules by exit code, signal or cause: fail the job, restart without "
        "charging maxRestarts, charge it, or replace the node's Pod",
    )
    pod_replacement: PodReplacementSpec = Field(
        default_factory=PodReplacementSpec,
        alias="podReplacement",
        description="how failed Pods are replaced",
        json_schema_extra={"default": {}},
    )
    rendezvous: RendezvousSpec = Field(
        default_factory=RendezvousSpec,
        description="where and how the nodes meet",
        json_schema_extra={"default": {}},
    )
    warm_start: WarmStartSpec = Field(
        default_factory=WarmStartSpec,
        alias="warmStart",
        description="fork restarted workers from a process that already imported torch",
        json_schema_extra={"default": {}},
    )
    checkpoint: CheckpointSpec = Field(
        default_factory=CheckpointSpec,
        description="in-memory checkpoints: the Pods' checkpoint volume",
        json_schema_extra={"default": {}},
    )
    in_process: InProcessSpec = Field(
        default_factory=InProcessSpec,
        alias="inProcess",
        description="restart the wrapped training function inside the running workers "
        "before restarting the worker processes",
        json_schema_extra={"default": {}},
    )
    template: dict[str, Any] = Field(
        description=(
            "A PodTemplateSpec holding the trainer container (named 'trainer', or the only "
            "container); its command is wrapped by the kelastic launcher"
        ),
        json_schema_extra={
            "x-kubernetes-preserve-unknown-fields": True,
            "required": ["spec"],
            "properties": {
                "metadata": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                "spec": {
                    "type": "object",
                    "x-kubernetes-preserve-unknown-fields": True,
                    "required": ["containers"],
                    "x-kubernetes-validations": TEMPLATE_CEL_RULES,
                    "properties": {
                        "containers": {
                            "type": "array",
                            "minItems": 1,
                            "maxItems": 64,
                            "items": {
                                "type": "object",
                                "x-kubernetes-preserve-unknown-fields": True,
                                "properties": {
                                    "name": {"type": "string", "maxLength": 63},
                                    "command": {
                                        "type": "array",
                                        "maxItems": 256,
                                        "items": {"type": "string"},
                                    },
                                },
                            },
                        }
                    },
                },
            },
        },
    )

    @model_validator(mode="after")
    def _check(self) -> ElasticJobSpec:
        lo, hi = self.min_nodes, self.max_nodes
        if lo > hi:
            raise ValueError(f"minReplicas ({lo}) must be <= maxReplicas ({hi})")
        if not lo <= self.replicas <= hi:
            raise ValueError(f"replicas ({self.replicas}) must be within [{lo}, {hi}]")
        trainer_container(self.template)  # raises ValueError with a clear message
        persist = self.checkpoint.persist
        if persist is not None:
            names = {v.get("name") for v in (self.template.get("spec") or {}).get("volumes") or []
                     if isinstance(v, dict)}  # fmt: skip
            if persist.volume in (contract.RUN_VOLUME_NAME, contract.CHECKPOINT_VOLUME_NAME):
                raise ValueError(
                    f"checkpoint.persist.volume {persist.volume!r} is a volume kelastic "
                    "makes for each Pod: name a volume every Pod shares"
                )
            if persist.volume not in names:
                raise ValueError(
                    f"checkpoint.persist.volume {persist.volume!r} is not a volume of "
                    "template.spec.volumes"
                )
        return self

    @property
    def min_nodes(self) -> int:
        """``minReplicas``, defaulting to ``replicas``."""
        return self.min_replicas if self.min_replicas is not None else self.replicas

    @property
    def max_nodes(self) -> int:
        """``maxReplicas``, defaulting to ``replicas``."""
        return self.max_replicas if self.max_replicas is not None else self.replicas


class Metadata(_Model):
    """The part of ``metadata`` kelastic reads."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str = Field(pattern=NAME_PATTERN, max_length=MAX_NAME_LENGTH)
    namespace: str = "default"
    uid: str | None = None


class ElasticJob(_Model):
    """An ElasticJob manifest (``apiVersion: kelastic.dev/v1alpha1``)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    api_version: Literal["kelastic.dev/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["ElasticJob"]
    metadata: Metadata
    spec: ElasticJobSpec


# ------------------------------------------------------------------------------ status

#: ``status.phase`` values, in the order a job usually passes through them.
#: ``Suspended``: ``spec.suspend`` is true (:mod:`kelastic_operator.suspend`).
PHASES: tuple[str, ...] = (
    "Pending", "Running", "Restarting", "Suspended", "Succeeded", "Failed"
)  # fmt: skip
Phase = Literal["Pending", "Running", "Restarting", "Suspended", "Succeeded", "Failed"]
#: Terminal phases: once reached, the operator creates no more Pods for the job.
TERMINAL_PHASES: frozenset[str] = frozenset({"Succeeded", "Failed"})
#: Condition types the operator maintains, each saying one thing, as Job and JobSet do:
#: ``RendezvousReady`` (always present: the workers train in a complete round), ``Complete``
#: and ``Failed`` (present once the job succeeded / failed; terminal), ``Suspended``
#: (present once the job was suspended: True while ``spec.suspend`` holds, False after it
#: was resumed). ``status.phase`` is the one-word summary.
CONDITION_TYPES: tuple[str, ...] = ("RendezvousReady", "Complete", "Failed", "Suspended")

_TIME: dict[str, JsonValue] = {"format": "date-time"}


class _Status(BaseModel):
    """Base of the status models: camelCase, unknown fields ignored when read back."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class Condition(_Status):
    """A standard Kubernetes condition (``metav1.Condition``)."""

    type: str = Field(description="what the condition is about, e.g. Running or Failed")
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(default="", description="CamelCase reason of the last transition")
    message: str = Field(default="", description="human-readable details")
    last_transition_time: str | None = Field(
        default=None,
        alias="lastTransitionTime",
        description="when status last changed (RFC 3339)",
        json_schema_extra=_TIME,
    )
    observed_generation: int | None = Field(
        default=None, alias="observedGeneration", description="generation the condition is for"
    )


class LastFailure(_Status):
    """The most recent failure the operator saw (``status.lastFailure``)."""

    pod: str = Field(description="the Pod that failed")
    rank: int | None = Field(default=None, description="global rank of the failed worker")
    exit_code: int | None = Field(default=None, alias="exitCode", description="exit code")
    signal: int | None = Field(default=None, description="signal that killed it")
    message: str = Field(default="", description="root cause (the termination message)")
    time: str | None = Field(default=None, description="when it failed", json_schema_extra=_TIME)


class InProcessRestart(_Status):
    """The job's latest in-process restart (``status.lastInProcessRestart``), as the
    sidecars recorded it in etcd (``inprocess/iteration``)."""

    iteration: int = Field(
        description="the in-process iteration the restart started (the function's call number)"
    )
    cause: str = Field(
        default="", description="why the wrapped function was restarted, e.g. exception or hang"
    )
    rank: int | None = Field(default=None, description="global rank that faulted, when known")
    node: str = Field(default="", description="the Pod whose sidecar reported the fault")
    message: str = Field(default="", description="the fault's one-line summary")
    time: str | None = Field(
        default=None, description="when the restart was agreed (RFC 3339)", json_schema_extra=_TIME
    )


class StragglerStatus(_Status):
    """A straggler now (``status.stragglers``), as its node's sidecar judged it."""

    pod: str = Field(description="the Pod (node) of the slow rank")
    local_rank: int = Field(alias="localRank", description="the slow rank's local rank")
    scope: str = Field(default="", description="the expires() scope its steps were timed in")
    median_seconds: float = Field(
        alias="medianSeconds", description="its median step time, seconds"
    )
    ratio: float = Field(description="its median over its node's other ranks' median")
    since: str | None = Field(
        default=None, description="when its sidecar judged it so", json_schema_extra=_TIME
    )


#: Most stragglers ``status.stragglers`` lists (the highest ratios).
MAX_STRAGGLERS_SHOWN: Final = 64


class LastRestart(_Status):
    """The newest worker-group restart charged (``status.lastRestart``), as the sidecars
    recorded it in etcd (the restart record's last charge; amended to name a stopped
    worker when one is found after a peer's charge)."""

    round: int = Field(description="the rendezvous round whose failure was charged")
    cause: str = Field(default="", description="e.g. worker_failure, hang, node_lost, oom")
    node: str = Field(default="", description="the Pod whose sidecar charged it")
    message: str = Field(default="", description="the root cause's one-line summary")


class LastHang(_Status):
    """The newest hung round, from every node's evidence (``status.lastHang``): the
    sidecars write where each of their workers was as the round hung
    (:mod:`kelastic.etcd_values.hangs`); :func:`kelastic.hang_where.summarize` names the
    culprit from it."""

    round: int = Field(description="the rendezvous round that hung")
    nodes: int = Field(
        default=0, description="nodes whose sidecars reported where their workers were"
    )
    message: str = Field(
        default="",
        description="which ranks held things up and where (file:line, function), and where "
        "the others waited; or that the evidence is inconclusive",
    )
    time: str | None = Field(
        default=None, description="when the operator first saw it", json_schema_extra=_TIME
    )


class LastCheckpoint(_Status):
    """What the current round's workers restored from the in-memory checkpoints
    (``status.lastCheckpoint``; ``spec.checkpoint``, ``kelastic.checkpoint``): before
    each round every sidecar records its node's verified committed steps in etcd, with
    the steps it sees complete on the job's persistence volume, and all agree on the
    highest step every rank holds in memory or can read from disk
    (:func:`kelastic.etcd_values.checkpoints.restore_of`). Steps saved during the round
    show at the next one (the sidecars record them only while the workers are stopped)."""

    round: int = Field(description="the rendezvous round whose workers restored it")
    step: int | None = Field(
        default=None, description="the step every rank loaded; absent with tier none"
    )
    tier: str = Field(
        default="",
        description="where from: memory (each rank's own node's slots), peer (the ranks "
        "whose node holds the step from a node that does: a replica, spec.checkpoint.replicas, "
        "or the rank's former node), disk (the job's "
        "persistence volume, spec.checkpoint.persist: no step every rank holds in memory is "
        "as new, e.g. after a Pod was replaced), or none (some rank held a step, but no "
        "step every rank holds: the workers started without one)",
    )
    time: str | None = Field(
        default=None,
        description="when the newest of the nodes' records of their slots was written",
        json_schema_extra=_TIME,
    )
    loaded_ranks: int | None = Field(
        default=None,
        alias="loadedRanks",
        ge=0,
        description="how many of the round's ranks have loaded the step so far (their nodes "
        "say so once all of a node's workers have); absent before the first node does",
    )
    load_seconds: float | None = Field(
        default=None,
        alias="loadSeconds",
        ge=0,
        description="the slowest of those ranks' load() calls, seconds: what the restore "
        "cost the job, beside where it came from",
    )


#: Most Nodes ``status.quarantinedNodes`` holds (the oldest drop out first).
MAX_QUARANTINED: Final = 64


class ElasticJobStatus(_Status):
    """``status`` of an ElasticJob, written by the operator only."""

    phase: Phase | None = Field(default=None, description="Pending, Running, Restarting, ...")
    conditions: list[Condition] = Field(
        default_factory=list,
        description="standard conditions",
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
    )
    replicas: int | None = Field(default=None, description="Pods that exist (scale subresource)")
    ready_replicas: int | None = Field(
        default=None, alias="readyReplicas", description="Pods that are running and ready"
    )
    selector: str | None = Field(default=None, description="label selector of the job's Pods")
    round: int | None = Field(default=None, description="current rendezvous round")
    world_size: int | None = Field(
        default=None, alias="worldSize", description="workers in the current round"
    )
    restarts_spent: int | None = Field(
        default=None, alias="restartsSpent", description="worker-group restarts spent so far"
    )
    in_process_restarts: int | None = Field(
        default=None,
        alias="inProcessRestarts",
        description=(
            "in-process restarts spent so far (spec.inProcess): every rank re-entered the "
            "training function in the same processes"
        ),
    )
    last_in_process_restart: InProcessRestart | None = Field(
        default=None, alias="lastInProcessRestart", description="the latest in-process restart"
    )
    replacements: int | None = Field(default=None, description="failed Pods replaced so far")
    next_replacement_time: str | None = Field(
        default=None,
        alias="nextReplacementTime",
        description="no failed Pod is replaced before this (backoff)",
        json_schema_extra=_TIME,
    )
    counted_failures: list[str] | None = Field(
        default=None,
        alias="countedFailures",
        max_length=10000,
        description=(
            "failed Pods (name@failure time) whose replacement is counted in replacements "
            "but that are not gone yet: a deletion retried later is not counted twice"
        ),
    )
    target_replicas: int | None = Field(
        default=None,
        alias="targetReplicas",
        description="Pods the operator keeps now: replicas, or fewer while shrunk",
    )
    admitted_replicas: int | None = Field(
        default=None,
        alias="admittedReplicas",
        description=(
            "Pods Kueue admitted (a job labelled kueue.x-k8s.io/queue-name): at most this "
            "many run; 0 while it waits for admission or was evicted"
        ),
    )
    last_resize_time: str | None = Field(
        default=None,
        alias="lastResizeTime",
        description="when targetReplicas last changed because Pods stayed Pending",
        json_schema_extra=_TIME,
    )
    last_failure: LastFailure | None = Field(
        default=None, alias="lastFailure", description="the most recent failure"
    )
    last_restart: LastRestart | None = Field(
        default=None, alias="lastRestart", description="the newest worker-group restart charged"
    )
    stragglers: list[StragglerStatus] = Field(
        default_factory=list,
        max_length=MAX_STRAGGLERS_SHOWN,
        description="the stragglers now (the highest ratios first)",
    )
    last_hang: LastHang | None = Field(
        default=None,
        alias="lastHang",
        description="the newest hung round: where every node's workers were",
    )
    last_checkpoint: LastCheckpoint | None = Field(
        default=None,
        alias="lastCheckpoint",
        description="the checkpoint step the current round's workers restored, and from where",
    )
    quarantined_nodes: list[str] = Field(
        default_factory=list,
        alias="quarantinedNodes",
        max_length=MAX_QUARANTINED,
        description="Nodes a Pod of this job failed its preflight check on (the most recent "
        "last); the job's new Pods are not scheduled there (node affinity)",
    )
    start_time: str | None = Field(
        default=None,
        alias="startTime",
        description="when the job first ran",
        json_schema_extra=_TIME,
    )
    completion_time: str | None = Field(
        default=None,
        alias="completionTime",
        description="when the job succeeded or failed",
        json_schema_extra=_TIME,
    )
    observed_generation: int | None = Field(
        default=None, alias="observedGeneration", description="generation last reconciled"
    )
    kopf: dict[str, Any] | None = Field(
        default=None,
        description="kopf's own bookkeeping",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )

    def as_patch(self) -> dict[str, Any]:
        """The status as a camelCase dict without unset fields (``kopf`` left out)."""
        return self.model_dump(by_alias=True, exclude_none=True, exclude={"kopf"})


def trainer_container(template: dict[str, Any]) -> dict[str, Any]:
    """Return the trainer container of a PodTemplateSpec.

    The container named ``trainer``, or the only container when there is one.

    Raises:
        ValueError: no containers, or several and none named ``trainer``, or the trainer
            has no ``command``.
    """
    spec = template.get("spec")
    containers = spec.get("containers") if isinstance(spec, dict) else None
    if not isinstance(containers, list) or not containers:
        raise ValueError("template.spec.containers must list the trainer container")
    named = [c for c in containers if isinstance(c, dict) and c.get("name") == TRAINER_CONTAINER]
    if named:
        container = named[0]
    elif len(containers) == 1 and isinstance(containers[0], dict):
        container = containers[0]
    else:
        raise ValueError(
            f"template.spec.containers has {len(containers)} containers; "
            f"name the training one {TRAINER_CONTAINER!r}"
        )
    command = container.get("command")
    if not isinstance(command, list) or not command or not all(isinstance(c, str) for c in command):
        raise ValueError(
            f"container {container.get('name', '?')!r} needs a command (a list of strings): "
            "the launcher wraps it"
        )
    return container


def parse_job(doc: Any, source: str = "<manifest>") -> ElasticJob:
    """Validate one decoded YAML/JSON document as an ElasticJob.

    Raises:
        ManifestError: listing every invalid field as ``spec.x.y: message``.
    """
    if not isinstance(doc, dict):
        raise ManifestError(f"{source}: expected a mapping, got {type(doc).__name__}")
    try:
        return ElasticJob.model_validate(doc)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(document)"
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"  {where}: {msg}")
        raise ManifestError(f"{source}: invalid ElasticJob:\n" + "\n".join(lines)) from None


def load_manifest(path: Path) -> ElasticJob:
    """Read the ElasticJob from a YAML file (the first document of kind ElasticJob).

    Raises:
        ManifestError: unreadable file, not UTF-8, bad YAML, nested too deep, no
            ElasticJob document, invalid spec; the message starts with ``path``.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason}); "
                            "is it a YAML manifest?") from None  # fmt: skip
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise ManifestError(f"{path}: not valid YAML: {exc}") from None
    except RecursionError:
        raise ManifestError(f"{path}: not a manifest: nested too deep to read") from None
    jobs = [d for d in docs if isinstance(d, dict) and d.get("kind") == KIND]
    if not jobs:
        raise ManifestError(f"{path}: no document with kind: {KIND}")
    return parse_job(jobs[0], str(path))
