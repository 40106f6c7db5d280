"""Build the Pod of one replica of an ElasticJob: the user's template plus kelastic's parts.

What :func:`build_pod` adds to the template (the user's own fields — resources, node
selectors, tolerations, volumes, env, init containers — are kept):

- the kelastic sidecar as a *native sidecar* (an init container with
  ``restartPolicy: Always``, Kubernetes >= 1.29), whose env is exactly what
  ``kelastic_sidecar.config.SidecarConfig.from_env`` reads (names from
  :mod:`kelastic.contract`): job name and uid, Pod name/namespace/IP through the downward
  API, etcd endpoints (and a TLS secret mount), min/max nodes, workers per node, the
  restart budget, rendezvous timeouts, the lease TTL, the HTTP port;
- the shared ``emptyDir`` ``kelastic-run`` at ``/var/run/kelastic`` in both containers,
  and ``shareProcessNamespace: true`` (the sidecar's timer server signals hung workers:
  it runs as the trainer's user, or as root with only CAP_KILL when that is unknown, see
  :func:`sidecar_security_context`);
- with ``spec.checkpoint.memory``, the memory-backed ``emptyDir`` ``kelastic-checkpoints``
  of that ``sizeLimit`` at ``/var/run/kelastic-checkpoints`` in both containers, and
  ``KELASTIC_CHECKPOINT_MEMORY`` for the sidecar (it allocates the volume at its start);
  with ``spec.checkpoint.persist``, the template's volume it names mounted in the
  sidecar at ``/var/run/kelastic-persist`` and the persistence settings
  (:func:`persist_env`) in the sidecar's env;
- the trainer's command wrapped by the launcher:
  ``python -m kelastic.launch --nproc-per-node N -- <command> <args>`` (args folded in),
  with ``--warm-start --preload <modules>`` when ``spec.warmStart.enabled``;
- with ``spec.inProcess.enabled``, the in-process restart settings
  (:func:`inprocess_env`: ``KELASTIC_INPROCESS=1``, its budget and timeouts) in *both*
  the sidecar's env (its coordinator) and the trainer's (the launcher's workers inherit
  it, and ``kelastic.inprocess.Wrapper`` reads it there);
- ``terminationMessagePath``/``Policy`` so the launcher's root-cause summary reaches the
  Pod status; ``restartPolicy: Never``; ``automountServiceAccountToken: false``;
- labels (job name, replica index, job uid), the spec's digest
  (:func:`pod_spec_hash`) as an annotation, and a controller owner reference to the job.

Over ~400 lines because it is one Pod's rendering from one spec: every part above (the
sidecar, its env and security context, the launcher command, volumes, the trainer's env,
the spec digest) must agree with the others, and it is tested as one function's output.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kelastic import __version__, contract, failure_policy
from kelastic.checkpoint.volume import parse_quantity
from kelastic.netcheck import encode_setting
from kelastic.preflight import encode_preflight

from .labels import (
    ANNOTATION_SPEC_HASH,
    LABEL_INDEX,
    LABEL_JOB,
    LABEL_UID,
    SIDECAR_CONTAINER,
    pod_name,
)
from .model import (
    API_GROUP,
    API_VERSION,
    KIND,
    TRAINER_CONTAINER,
    ElasticJobSpec,
    InProcessSpec,
    StragglersSpec,
    WarmStartSpec,
)
from .placement import avoid_nodes

#: Where a ``rendezvous.tlsSecret`` is mounted in the sidecar.
ETCD_TLS_MOUNT = "/etc/kelastic/etcd-tls"
ETCD_TLS_VOLUME = "kelastic-etcd-tls"
HTTP_PORT_NAME = "kelastic-http"


@dataclass(frozen=True)
class PodSettings:
    """Operator-wide settings of the Pods it builds.

    Attributes:
        sidecar_image: image holding ``kelastic-sidecar``.
        etcd_endpoints: ``host:port`` of the operator's default etcd, used when a job's
            ``rendezvous.etcdEndpoints`` is empty.
        http_port: the sidecar's HTTP port (``/metrics``, ``/healthz``, ``/readyz``).
        stop_grace: seconds between SIGTERM and SIGKILL when workers are stopped.
        sidecar_resources: the sidecar container's ``resources``.
        image_pull_policy: the sidecar's ``imagePullPolicy``.
        python: the interpreter in the trainer image that runs ``-m kelastic.launch``.
    """

    sidecar_image: str = f"ghcr.io/kelastic/kelastic:{__version__}"
    etcd_endpoints: tuple[str, ...] = ()
    http_port: int = contract.DEFAULT_HTTP_PORT
    stop_grace: float = contract.DEFAULT_STOP_GRACE
    sidecar_resources: dict[str, Any] = field(
        default_factory=lambda: {
            "requests": {"cpu": "50m", "memory": "64Mi"},
            "limits": {"memory": "256Mi"},
        }
    )
    image_pull_policy: str = "IfNotPresent"
    python: str = "python"


class PodBuildError(ValueError):
    """The job cannot be turned into a Pod (no etcd endpoint, a broken template)."""


def _num(value: float) -> str:
    return f"{value:g}"


def etcd_endpoints(spec: ElasticJobSpec, settings: PodSettings) -> list[str]:
    """The etcd endpoints of a job: its own, else the operator's default.

    Raises:
        PodBuildError: neither the job nor the operator names one.
    """
    endpoints = list(spec.rendezvous.etcd_endpoints) or list(settings.etcd_endpoints)
    if not endpoints:
        raise PodBuildError(
            "no etcd endpoint: set spec.rendezvous.etcdEndpoints or the operator's --etcd-endpoints"
        )
    return endpoints


def sidecar_env(
    name: str, uid: str, spec: ElasticJobSpec, settings: PodSettings
) -> list[dict[str, Any]]:
    """The sidecar container's env (``SidecarConfig.from_env``'s variables).

    Raises:
        PodBuildError: no etcd endpoint (see :func:`etcd_endpoints`).
    """
    rdzv = spec.rendezvous

    def field_ref(path: str) -> dict[str, Any]:
        return {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}

    env: list[dict[str, Any]] = [
        {"name": contract.ENV_JOB_NAME, "value": name},
        {"name": contract.ENV_NAMESPACE, "valueFrom": field_ref("metadata.namespace")},
        {"name": contract.ENV_JOB_UID, "value": uid},
        {"name": contract.ENV_POD_NAME, "valueFrom": field_ref("metadata.name")},
        {"name": contract.ENV_POD_IP, "valueFrom": field_ref("status.podIP")},
        {"name": contract.ENV_POD_UID, "valueFrom": field_ref("metadata.uid")},
        {"name": contract.ENV_HOST_NODE, "valueFrom": field_ref("spec.nodeName")},
        {"name": contract.ENV_ETCD_ENDPOINTS, "value": ",".join(etcd_endpoints(spec, settings))},
        {"name": contract.ENV_MIN_NODES, "value": str(spec.min_nodes)},
        {"name": contract.ENV_MAX_NODES, "value": str(spec.max_nodes)},
        {"name": contract.ENV_NPROC_PER_NODE, "value": str(spec.nproc_per_node)},
        {"name": contract.ENV_MAX_RESTARTS, "value": str(spec.max_restarts)},
        {"name": contract.ENV_JOIN_TIMEOUT, "value": _num(rdzv.join_timeout_seconds)},
        {"name": contract.ENV_LAST_CALL_TIMEOUT, "value": _num(rdzv.last_call_timeout_seconds)},
        {"name": contract.ENV_LEASE_TTL, "value": str(rdzv.lease_ttl_seconds)},
        {"name": contract.ENV_STOP_GRACE, "value": _num(settings.stop_grace)},
        {"name": contract.ENV_HTTP_PORT, "value": str(settings.http_port)},
        {"name": contract.ENV_RUN_DIR, "value": contract.DEFAULT_RUN_DIR},
        {"name": contract.ENV_STRAGGLER_FACTOR, "value": _num(spec.stragglers.factor)},
        {"name": contract.ENV_STRAGGLER_MIN_STEPS, "value": str(spec.stragglers.min_steps)},
        *inprocess_env(spec.in_process),
        *netcheck_env(spec),
    ]
    if spec.failure_policy is not None:  # the codec the sidecar reads them with
        rules = failure_policy.encode_rules(spec.failure_policy.to_rules())
        env.append({"name": failure_policy.ENV_FAILURE_POLICY, "value": rules})
    memory = spec.checkpoint.memory_bytes
    if memory is not None:  # the volume is allocated in full at the sidecar's start
        env.append({"name": contract.ENV_CHECKPOINT_DIR, "value": contract.DEFAULT_CHECKPOINT_DIR})
        env.append({"name": contract.ENV_CHECKPOINT_MEMORY, "value": str(memory)})
    if spec.checkpoint.replicated and memory is not None:  # any rank's copy restores any
        env.append(
            {"name": contract.ENV_CHECKPOINT_LAYOUT, "value": contract.StateLayout.REPLICATED}
        )
    if spec.checkpoint.serves_slots and not spec.checkpoint.replicas:  # served, not sent
        env.append({"name": contract.ENV_REPLICA_PORT, "value": str(contract.DEFAULT_REPLICA_PORT)})
    if spec.checkpoint.replicas:  # its slots sent to the next node, served on its port
        env.append(
            {"name": contract.ENV_CHECKPOINT_REPLICAS, "value": str(spec.checkpoint.replicas)}
        )
        # the Node's zone, copied onto the Pod's labels at binding (Kubernetes 1.35+):
        # the replicas' ring puts neighbours in different zones where it can
        zone = field_ref(f"metadata.labels['{contract.ZONE_LABEL}']")
        env.append({"name": contract.ENV_FAILURE_DOMAIN, "valueFrom": zone})
        env.append(
            {
                "name": contract.ENV_CHECKPOINT_REPLICATION_RATE,
                "value": str(spec.checkpoint.replication_bytes_per_second),
            }
        )
        env.append({"name": contract.ENV_REPLICA_PORT, "value": str(contract.DEFAULT_REPLICA_PORT)})
        env.append(
            {
                "name": contract.ENV_CHECKPOINT_REPLICATE_EVERY,
                "value": str(spec.checkpoint.replicate_every_steps),
            }
        )
    env.extend(persist_env(spec))
    if rdzv.tls_secret:
        env.append({"name": contract.ENV_ETCD_TLS_DIR, "value": ETCD_TLS_MOUNT})
    if rdzv.auth_secret:  # etcd user and password, from a kubernetes.io/basic-auth Secret
        for var, key in (
            (contract.ENV_ETCD_USER, "username"),
            (contract.ENV_ETCD_PASSWORD, "password"),
        ):
            ref = {"secretKeyRef": {"name": rdzv.auth_secret, "key": key}}
            env.append({"name": var, "valueFrom": ref})
    return env


def sidecar_ports(spec: ElasticJobSpec, settings: PodSettings) -> list[dict[str, Any]]:
    """The sidecar's ports: its HTTP port and, when it serves its slots
    (``spec.checkpoint.replicas``, or a replicated state), the port the job's other
    sidecars send replicas to and fetch slots from
    (:data:`~kelastic.contract.DEFAULT_REPLICA_PORT`)."""
    ports = [{"name": HTTP_PORT_NAME, "containerPort": settings.http_port, "protocol": "TCP"}]
    if spec.checkpoint.serves_slots:
        port = contract.DEFAULT_REPLICA_PORT
        ports.append({"name": contract.REPLICA_PORT_NAME, "containerPort": port, "protocol": "TCP"})
    return ports


def persist_env(spec: ElasticJobSpec) -> list[dict[str, Any]]:
    """The sidecar's persistence settings (``spec.checkpoint.persist``) as env entries:
    the folder (the volume's mount, :data:`~kelastic.contract.PERSIST_MOUNT`, then
    ``path``), ``everySteps``, ``onStop`` and ``keep``; none when unset."""
    persist = spec.checkpoint.persist
    if persist is None:
        return []
    return [
        {"name": contract.ENV_CHECKPOINT_PERSIST_DIR,
         "value": f"{contract.PERSIST_MOUNT}/{persist.path}"},
        {"name": contract.ENV_CHECKPOINT_PERSIST_EVERY, "value": str(persist.every_steps)},
        {"name": contract.ENV_CHECKPOINT_PERSIST_ON_STOP, "value": "1" if persist.on_stop else "0"},
        {"name": contract.ENV_CHECKPOINT_PERSIST_KEEP, "value": str(persist.keep)},
    ]  # fmt: skip


def trainer_persist_env(spec: ElasticJobSpec) -> list[dict[str, Any]]:
    """The trainer's part of ``spec.checkpoint.persist``: the folder, as the sidecar's (a
    step restored from disk is read there: :func:`persist_mount`), and ``everySteps``
    when set (its saves mark those steps due, :mod:`kelastic.checkpoint.due`); none
    without ``persist``."""
    persist = spec.checkpoint.persist
    if persist is None:
        return []
    env = [{"name": contract.ENV_CHECKPOINT_PERSIST_DIR,
            "value": f"{contract.PERSIST_MOUNT}/{persist.path}"}]  # fmt: skip
    if persist.every_steps:
        env.append({"name": contract.ENV_CHECKPOINT_PERSIST_EVERY,
                    "value": str(persist.every_steps)})  # fmt: skip
    return env


def persist_mount(spec: ElasticJobSpec, *, read_only: bool) -> dict[str, Any] | None:
    """The mount of ``spec.checkpoint.persist``'s volume at
    :data:`kelastic.contract.PERSIST_MOUNT`: read-write in the sidecar (it writes the
    steps), read only in the trainer (its workers read a step restored from disk; a
    trainer may mount the same volume elsewhere too). None without ``persist``."""
    persist = spec.checkpoint.persist
    if persist is None:
        return None
    mount: dict[str, Any] = {"name": persist.volume, "mountPath": contract.PERSIST_MOUNT}
    if read_only:
        mount["readOnly"] = True
    return mount


def inprocess_env(in_process: InProcessSpec) -> list[dict[str, Any]]:
    """The in-process restart settings as env entries, the same for sidecar and trainer.

    Args:
        in_process: ``spec.inProcess``.

    Returns:
        ``KELASTIC_INPROCESS=1``, ``KELASTIC_INPROCESS_MAX_RESTARTS``, the soft and hard
        timeouts (seconds) and ``KELASTIC_INPROCESS_SPARES`` (spare ranks per node) when
        enabled; an empty list when not (the Wrapper then calls the training function
        once, and the sidecar coordinates nothing).
    """
    if not in_process.enabled:
        return []
    return [
        {"name": contract.ENV_INPROCESS, "value": "1"},
        {"name": contract.ENV_INPROCESS_MAX_RESTARTS, "value": str(in_process.max_restarts)},
        {
            "name": contract.ENV_INPROCESS_SOFT_TIMEOUT,
            "value": _num(in_process.soft_timeout_seconds),
        },
        {
            "name": contract.ENV_INPROCESS_HARD_TIMEOUT,
            "value": _num(in_process.hard_timeout_seconds),
        },
        {"name": contract.ENV_INPROCESS_SPARES, "value": str(in_process.spare_ranks)},
    ]


def preflight_env(spec: ElasticJobSpec) -> list[dict[str, Any]]:
    """``spec.preflight`` as the trainer's ``$KELASTIC_PREFLIGHT`` entry
    (:mod:`kelastic.preflight`'s codec) and :func:`netcheck_env`; an empty list when there
    is none."""
    check = spec.preflight.to_preflight() if spec.preflight is not None else None
    env = [{"name": contract.ENV_PREFLIGHT, "value": encode_preflight(check)}] if check else []
    return env + netcheck_env(spec)


def netcheck_env(spec: ElasticJobSpec) -> list[dict[str, Any]]:
    """``spec.preflight.network`` as ``$KELASTIC_NETCHECK`` (:mod:`kelastic.netcheck`'s
    setting codec), in both containers: the sidecar runs the check, the launcher starts
    its checker ahead; an empty list when there is none."""
    network = spec.preflight.network if spec.preflight is not None else None
    if network is None:
        return []
    return [{"name": contract.ENV_NETCHECK, "value": encode_setting(network.to_setting())}]


def _run_mount() -> dict[str, Any]:
    return {"name": contract.RUN_VOLUME_NAME, "mountPath": contract.DEFAULT_RUN_DIR}


def _checkpoint_mount() -> dict[str, Any]:
    return {"name": contract.CHECKPOINT_VOLUME_NAME, "mountPath": contract.DEFAULT_CHECKPOINT_DIR}


def checkpoint_volume(spec: ElasticJobSpec) -> dict[str, Any] | None:
    """The Pod's checkpoint volume (``spec.checkpoint.memory`` set): an ``emptyDir`` with
    ``medium: Memory`` and that ``sizeLimit``, mounted in both containers at
    :data:`kelastic.contract.DEFAULT_CHECKPOINT_DIR`; None without it."""
    memory = spec.checkpoint.memory
    if memory is None:
        return None
    return {
        "name": contract.CHECKPOINT_VOLUME_NAME,
        "emptyDir": {"medium": "Memory", "sizeLimit": memory},
    }


def sidecar_security_context(pod_spec: dict[str, Any], trainer: dict[str, Any]) -> dict[str, Any]:
    """The sidecar's ``securityContext``: able to signal the trainer's workers.

    The sidecar's timer server kills hung workers in the trainer container (shared
    process namespace), which Linux allows only to the same user or with CAP_KILL. So
    the sidecar runs as the trainer's user when the template names it (the trainer
    container's ``runAsUser``/``runAsGroup``, else the Pod's), with every capability
    dropped. When it does not, the trainer runs as its image's user, which the operator
    cannot know (GPU images often run as root): the sidecar then runs as root with only
    CAP_KILL, unless the Pod asks for ``runAsNonRoot`` (set ``runAsUser`` on the trainer
    in such namespaces; the sidecar then keeps its image's user, 65532). The run
    volume's FIFO and control socket are writable by every user of the Pod. It gets the
    ``RuntimeDefault`` seccomp profile unless the Pod names one, so that with a non-root
    trainer it meets Pod Security's ``restricted`` level.

    Args:
        pod_spec: the template's Pod spec.
        trainer: the trainer container.

    Returns:
        A container ``securityContext``.
    """
    pod_sc = pod_spec.get("securityContext") or {}
    own_sc = trainer.get("securityContext") or {}
    user = own_sc.get("runAsUser", pod_sc.get("runAsUser"))
    group = own_sc.get("runAsGroup", pod_sc.get("runAsGroup"))
    context: dict[str, Any] = {"allowPrivilegeEscalation": False}
    if not pod_sc.get("seccompProfile"):  # Pod Security "restricted" wants one
        context["seccompProfile"] = {"type": "RuntimeDefault"}
    if isinstance(user, int):
        context["runAsUser"] = user
        if isinstance(group, int):
            context["runAsGroup"] = group
        context["runAsNonRoot"] = user != 0
        context["capabilities"] = {"drop": ["ALL"], **({"add": ["KILL"]} if user == 0 else {})}
    elif own_sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
        context["runAsNonRoot"] = True
        context["capabilities"] = {"drop": ["ALL"]}
    else:
        context.update(
            runAsUser=0, runAsNonRoot=False, capabilities={"drop": ["ALL"], "add": ["KILL"]}
        )
    return context


def sidecar_resources(resources: dict[str, Any], spec: ElasticJobSpec) -> dict[str, Any]:
    """The sidecar's ``resources`` (a copy of ``resources``): with
    ``spec.checkpoint.memory``, its memory limit grows by the volume's bytes. At its start
    the sidecar writes the whole memory-backed volume once (a volume that cannot hold it
    fails then, not with SIGBUS at a save) and frees it at once; tmpfs pages are charged
    to the cgroup of the process that writes them, so under its own limit (256Mi by
    default) a larger volume would get the sidecar OOM-killed at every start. The request
    is unchanged (nothing is held after the check). A limit in another form than
    :func:`kelastic.checkpoint.volume.parse_quantity` reads is left as it is."""
    out = copy.deepcopy(resources)
    extra = spec.checkpoint.memory_bytes
    limits = out.get("limits")
    limit = limits.get("memory") if isinstance(limits, dict) else None
    if extra is None or not isinstance(limits, dict) or not isinstance(limit, str):
        return out
    try:
        total = parse_quantity(limit) + extra
    except ValueError:
        return out
    limits["memory"] = f"{total >> 20}Mi" if total % (1 << 20) == 0 else str(total)
    return out


def sidecar_container(
    name: str,
    uid: str,
    spec: ElasticJobSpec,
    settings: PodSettings,
    security_context: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The kelastic sidecar as a native sidecar (init container, ``restartPolicy: Always``).

    Args:
        name, uid: the job's name and uid.
        spec: the job's spec.
        settings: operator-wide settings.
        security_context: see :func:`sidecar_security_context` (none when ``None``).

    Raises:
        PodBuildError: no etcd endpoint.
    """
    mounts = [_run_mount()]
    if spec.checkpoint.memory is not None:
        mounts.append(_checkpoint_mount())
    if (persisted := persist_mount(spec, read_only=False)) is not None:  # the shared volume
        mounts.append(persisted)
    if spec.rendezvous.tls_secret:
        mounts.append({"name": ETCD_TLS_VOLUME, "mountPath": ETCD_TLS_MOUNT, "readOnly": True})
    probe = {"httpGet": {"path": "/healthz", "port": HTTP_PORT_NAME}}
    # /readyz: workers of a completed round are running -> the Pod is Ready (readyReplicas)
    ready = {"httpGet": {"path": "/readyz", "port": HTTP_PORT_NAME}}
    return {
        "name": SIDECAR_CONTAINER,
        "image": settings.sidecar_image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["kelastic-sidecar"],
        "restartPolicy": "Always",
        "env": sidecar_env(name, uid, spec, settings),
        "ports": sidecar_ports(spec, settings),
        "startupProbe": {**probe, "periodSeconds": 1, "failureThreshold": 60},
        "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 3},
        "readinessProbe": {**ready, "periodSeconds": 5, "failureThreshold": 1},
        "volumeMounts": mounts,
        "resources": sidecar_resources(settings.sidecar_resources, spec),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        **({"securityContext": security_context} if security_context is not None else {}),
    }


def launcher_command(
    container: dict[str, Any],
    nproc: int,
    python: str = "python",
    warm_start: WarmStartSpec | None = None,
) -> list[str]:
    """The trainer's command wrapped by the launcher, its ``args`` folded in.

    Args:
        container: the trainer container (``command`` and ``args`` are read).
        nproc: workers per node.
        python: the interpreter that runs ``-m kelastic.launch``.
        warm_start: adds ``--warm-start --preload ...`` when enabled.

    Raises:
        PodBuildError: the container has no command (a list of strings).
    """
    command = container.get("command")
    if not isinstance(command, list) or not command:
        raise PodBuildError(f"container {container.get('name')!r} needs a command to wrap")
    args = container.get("args") or []
    warm: list[str] = []
    if warm_start is not None and warm_start.enabled:
        warm = ["--warm-start", "--preload", ",".join(warm_start.preload)]
    return [
        python, "-m", "kelastic.launch", "--nproc-per-node", str(nproc), *warm, "--",
        *(str(c) for c in command), *(str(a) for a in args),
    ]  # fmt: skip


def trainer_lifecycle(trainer: dict[str, Any], python: str = "python") -> dict[str, Any]:
    """The trainer's ``lifecycle``: its ``preStop`` hook is ``python -m kelastic.prestop``
    (the kubelet runs it before the trainer's SIGTERM: the sidecar's node leaves the
    rendezvous first, with the operator's departure notice when a disruption takes the
    Pod, so its peers re-form charging nothing; :mod:`kelastic.prestop`). A ``preStop``
    of the user's own is kept instead (the kubelet runs one hook): the Pod then stops as
    without ours, its peers may charge a drain as a lost node. ``postStart`` is kept."""
    lifecycle = dict(trainer.get("lifecycle") or {})
    if not lifecycle.get("preStop"):
        lifecycle["preStop"] = {"exec": {"command": [python, "-m", "kelastic.prestop"]}}
    return lifecycle


def _trainer_mounts(trainer: dict[str, Any], spec: ElasticJobSpec) -> list[dict[str, Any]]:
    """The trainer's mounts: the user's, kelastic's run volume and checkpoint volume
    (unless mounted under those names already), and the persistence volume read only at
    :data:`kelastic.contract.PERSIST_MOUNT` (beside the user's own mount of it, if any)."""
    mounts = list(trainer.get("volumeMounts") or [])
    wanted = [_run_mount()] + ([_checkpoint_mount()] if spec.checkpoint.memory else [])
    for mount in wanted:
        if not any(m.get("name") == mount["name"] for m in mounts):
            mounts.append(mount)
    if (persisted := persist_mount(spec, read_only=True)) is not None:
        mounts = [m for m in mounts if m.get("mountPath") != contract.PERSIST_MOUNT]
        mounts.append(persisted)
    return mounts


def _trainer_index(containers: list[dict[str, Any]]) -> int:
    for i, c in enumerate(containers):
        if c.get("name") == TRAINER_CONTAINER:
            return i
    if len(containers) == 1:
        return 0
    raise PodBuildError(f"template has several containers and none named {TRAINER_CONTAINER!r}")


def trainer_name(template: dict[str, Any]) -> str:
    """The trainer container's name in the template (``trainer`` or the only container)."""
    containers = (template.get("spec") or {}).get("containers") or []
    return str(containers[_trainer_index(containers)].get("name", TRAINER_CONTAINER))


def build_pod(
    name: str,
    namespace: str,
    uid: str,
    spec: ElasticJobSpec,
    index: int,
    settings: PodSettings,
    avoid: Sequence[str] = (),
) -> dict[str, Any]:
    """The Pod ``<name>-<index>`` of the ElasticJob ``namespace/name`` (uid ``uid``).

    Args:
        name, namespace, uid: the job's identity (uid: run id and owner reference).
        spec: the validated spec (its template is not modified).
        index: the replica index (>= 0).
        settings: operator-wide settings.
        avoid: Nodes the Pod must not run on (``status.quarantinedNodes``:
            :func:`~kelastic_operator.placement.avoid_nodes`); not part of the spec's
            digest, so a new quarantine replaces no running Pod.

    Returns:
        A Pod manifest (``apiVersion: v1``) as a plain dict.

    Raises:
        PodBuildError: no etcd endpoint, or no trainer container.
        ValueError: a negative index.
    """
    template = copy.deepcopy(spec.template)
    tmeta = template.get("metadata") or {}
    pspec: dict[str, Any] = template.get("spec") or {}
    containers: list[dict[str, Any]] = pspec.get("containers") or []
    if not containers:
        raise PodBuildError("template.spec.containers must list the trainer container")
    trainer = containers[_trainer_index(containers)]
    trainer["command"] = launcher_command(
        trainer, spec.nproc_per_node, settings.python, spec.warm_start
    )
    trainer.pop("args", None)
    # The in-process settings are the spec's, as in the sidecar (the two must agree), and
    # so is the preflight check: a user's own entry of one of these names is replaced.
    inprocess = inprocess_env(spec.in_process) + preflight_env(spec) + trainer_persist_env(spec)
    ours = {e["name"] for e in inprocess}
    env = [
        e for e in trainer.get("env") or [] if not isinstance(e, dict) or e.get("name") not in ours
    ]
    have = {e.get("name") for e in env if isinstance(e, dict)}
    for var, value in (
        (contract.ENV_RUN_DIR, contract.DEFAULT_RUN_DIR),
        (contract.ENV_STOP_GRACE, _num(settings.stop_grace)),
        (contract.ENV_CHECKPOINT_DIR, contract.DEFAULT_CHECKPOINT_DIR),
    ):
        if var == contract.ENV_CHECKPOINT_DIR and spec.checkpoint.memory is None:
            continue
        if var not in have:
            env.append({"name": var, "value": value})
    trainer["env"] = env + inprocess
    trainer["volumeMounts"] = _trainer_mounts(trainer, spec)
    trainer["terminationMessagePath"] = contract.DEFAULT_TERMINATION_LOG
    trainer["terminationMessagePolicy"] = "FallbackToLogsOnError"
    trainer["lifecycle"] = trainer_lifecycle(trainer, settings.python)

    ours = {contract.RUN_VOLUME_NAME, contract.CHECKPOINT_VOLUME_NAME}
    volumes = [v for v in pspec.get("volumes") or [] if v.get("name") not in ours]
    volumes.append({"name": contract.RUN_VOLUME_NAME, "emptyDir": {}})
    if (ckpt := checkpoint_volume(spec)) is not None:
        volumes.append(ckpt)
    if spec.rendezvous.tls_secret:
        volumes.append(
            {
                "name": ETCD_TLS_VOLUME,
                "secret": {"secretName": spec.rendezvous.tls_secret, "defaultMode": 0o400},
            }
        )
    init = [c for c in pspec.get("initContainers") or [] if c.get("name") != SIDECAR_CONTAINER]
    init.append(
        sidecar_container(name, uid, spec, settings, sidecar_security_context(pspec, trainer))
    )
    pspec.update(
        {
            "containers": containers,
            "initContainers": init,
            "volumes": volumes,
            "restartPolicy": "Never",
            "shareProcessNamespace": True,
            "automountServiceAccountToken": False,
        }
    )
    avoid_nodes(pspec, avoid)
    labels = {
        **(tmeta.get("labels") or {}),
        LABEL_JOB: name,
        LABEL_INDEX: str(index),
        LABEL_UID: uid,
    }
    metadata: dict[str, Any] = {
        "name": pod_name(name, index),
        "namespace": namespace,
        "labels": labels,
        "ownerReferences": [
            {
                "apiVersion": f"{API_GROUP}/{API_VERSION}",
                "kind": KIND,
                "name": name,
                "uid": uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }
    metadata["annotations"] = {
        **(tmeta.get("annotations") or {}),
        ANNOTATION_SPEC_HASH: pod_spec_hash(spec),
    }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pspec}


#: Spec fields that do not shape the Pods: changing them replaces no Pod (``replicas``
#: is scaling; the rest is the operator's own policy). ``in_process`` is not among them:
#: it is in both containers' env, so changing it needs new Pods; but while it is disabled
#: it puts nothing in the Pod, and :func:`pod_spec_hash` leaves it out then (so the
#: field's arrival, or an edit of a disabled one, replaces no running Pod).
_NOT_IN_POD = frozenset(
    {
        "replicas",
        "pending_timeout_seconds",
        "start_timeout_seconds",
        "cleanup_policy",
        "ttl_seconds_after_finished",
        "suspend",
        "pod_replacement",
        "node_lost_seconds",
    }
)


def pod_spec_hash(spec: ElasticJobSpec) -> str:
    """A digest of what in ``spec`` shapes the job's Pods (template, workers per node,
    min/max nodes, restart budget, rendezvous settings, warm start, in-process restart
    when enabled, failure rules and the checkpoint volume when set): 16 hex characters.

    Stored on each Pod (:data:`~kelastic_operator.labels.ANNOTATION_SPEC_HASH`); the
    operator replaces the Pods whose digest differs from the job's (see
    :func:`kelastic_operator.reconcile.reconcile`). Scaling (``replicas``) and the
    operator's policies do not change it.
    """
    left_out = set(_NOT_IN_POD) | (set() if spec.in_process.enabled else {"in_process"})
    if spec.failure_policy is None:  # absent, it leaves the digest of older jobs alone
        left_out.add("failure_policy")
    if spec.checkpoint.memory is None:  # likewise
        left_out.add("checkpoint")
    exclude: dict[str, Any] = dict.fromkeys(left_out, True)
    if spec.checkpoint.memory is not None:  # likewise, each part left out while unset
        unset = {"persist"} if spec.checkpoint.persist is None else set()
        if not spec.checkpoint.replicas:
            unset |= {"replicas", "replication_rate", "replicate_every_steps"}
        if not spec.checkpoint.replicated:
            unset.add("state_layout")
        if unset:
            exclude["checkpoint"] = dict.fromkeys(unset, True)
    # the sidecar's verdict shapes the Pod (its env), the action is the operator's
    defaults = StragglersSpec()
    verdict = (spec.stragglers.factor, spec.stragglers.min_steps)
    same = verdict == (defaults.factor, defaults.min_steps)
    exclude["stragglers"] = True if same else {"action": True}
    shaping = spec.model_dump(mode="json", by_alias=True, exclude=exclude)
    text = json.dumps(shaping, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
