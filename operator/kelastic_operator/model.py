"""The ElasticJob resource as a pydantic model: the single source of truth for its spec.

``kelastic run`` (local mode) and the operator read manifests through
:func:`load_manifest`; the CRD schema is generated from these classes.
Field names are the camelCase of the Kubernetes resource.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kelastic import contract

API_GROUP = "kelastic.dev"
API_VERSION = "v1alpha1"
KIND = "ElasticJob"
TRAINER_CONTAINER = "trainer"


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
    join_timeout_seconds: float = Field(
        default=contract.DEFAULT_JOIN_TIMEOUT, gt=0, alias="joinTimeoutSeconds"
    )
    last_call_timeout_seconds: float = Field(
        default=contract.DEFAULT_LAST_CALL_TIMEOUT, gt=0, alias="lastCallTimeoutSeconds"
    )
    lease_ttl_seconds: int = Field(
        default=contract.DEFAULT_LEASE_TTL, ge=1, le=300, alias="leaseTTLSeconds"
    )


class PodReplacementSpec(_Model):
    """How the operator replaces failed Pods (``spec.podReplacement``)."""

    max_replacements: int = Field(default=10, ge=0, alias="maxReplacements")
    backoff_seconds: float = Field(default=10.0, ge=0, alias="backoffSeconds")
    max_backoff_seconds: float = Field(default=300.0, ge=0, alias="maxBackoffSeconds")


class ElasticJobSpec(_Model):
    """``spec`` of an ElasticJob.

    ``replicas`` nodes (Pods) are wanted; rendezvous admits between ``minReplicas`` and
    ``maxReplicas`` of them, each running ``nprocPerNode`` workers. ``maxRestarts`` is
    the job's global worker-group restart budget (scale events do not spend it).
    """

    replicas: int = Field(ge=1, le=10000)
    min_replicas: int | None = Field(default=None, ge=1, alias="minReplicas")
    max_replicas: int | None = Field(default=None, ge=1, alias="maxReplicas")
    nproc_per_node: int = Field(default=1, ge=1, le=1024, alias="nprocPerNode")
    max_restarts: int = Field(default=contract.DEFAULT_MAX_RESTARTS, ge=0, alias="maxRestarts")
    pending_timeout_seconds: float = Field(default=600.0, gt=0, alias="pendingTimeoutSeconds")
    cleanup_policy: Literal["None", "Running", "All"] = Field(
        default="Running", alias="cleanupPolicy"
    )
    pod_replacement: PodReplacementSpec = Field(
        default_factory=PodReplacementSpec, alias="podReplacement"
    )
    rendezvous: RendezvousSpec = Field(default_factory=RendezvousSpec)
    template: dict[str, Any]

    @model_validator(mode="after")
    def _check(self) -> ElasticJobSpec:
        lo, hi = self.min_nodes, self.max_nodes
        if lo > hi:
            raise ValueError(f"minReplicas ({lo}) must be <= maxReplicas ({hi})")
        if not lo <= self.replicas <= hi:
            raise ValueError(f"replicas ({self.replicas}) must be within [{lo}, {hi}]")
        trainer_container(self.template)  # raises ValueError with a clear message
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
    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=52)
    namespace: str = "default"
    uid: str | None = None


class ElasticJob(_Model):
    """An ElasticJob manifest (``apiVersion: kelastic.dev/v1alpha1``)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    api_version: Literal["kelastic.dev/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["ElasticJob"]
    metadata: Metadata
    spec: ElasticJobSpec


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
        ManifestError: unreadable file, bad YAML, no ElasticJob document, invalid spec.
    """
    try:
        text = path.read_text()
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise ManifestError(f"{path}: not valid YAML: {exc}") from None
    jobs = [d for d in docs if isinstance(d, dict) and d.get("kind") == KIND]
    if not jobs:
        raise ManifestError(f"{path}: no document with kind: {KIND}")
    return parse_job(jobs[0], str(path))
