"""The in-memory object store: the API server's semantics without HTTP.

Everything here runs on the server's event-loop thread and is synchronous, so each
operation is atomic. It keeps a global, monotonic resourceVersion; a bounded history of
events for watches that resume from a resourceVersion (older ones get 410 Gone); uids,
generations, timestamps, generateName; deletion with finalizers; owner-reference garbage
collection (background, foreground, orphan); namespace and CRD cleanup; status and scale
subresources; and, for custom resources, schema pruning/defaulting/validation and CEL rules.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import random
import re
import string
import uuid
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from . import crds, errors, jsonpath, schema
from .errors import ApiError, FieldError
from .patch import PatchError, json_patch, merge_patch, strategic_merge_patch
from .resources import BUILTIN_TYPES, ResourceType, types_from_crd, version_priority
from .selection import selector_to_string

Obj = dict[str, Any]
Key = tuple[str, str]  # (namespace or "", name)

CRD_CLEANUP = "customresourcecleanup.apiextensions.k8s.io"
FOREGROUND = "foregroundDeletion"
INITIAL_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
_SYSTEM_META = (
    "uid",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "generation",
)
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Event:
    rv: int
    key: str  # ResourceType.storage_key
    type: str  # ADDED, MODIFIED, DELETED
    obj: Obj  # the state after the change (for DELETED: the last state)
    old: Obj | None = None  # the state before (None for ADDED)


@dataclass(eq=False)
class Watcher:
    key: str
    namespace: str | None
    queue: asyncio.Queue[Event | None] = field(default_factory=asyncio.Queue)  # None: stop

    def wants(self, event: Event) -> bool:
        namespace = event.obj.get("metadata", {}).get("namespace")
        return event.key == self.key and self.namespace in (None, namespace)


@dataclass
class WriteOptions:
    dry_run: bool = False
    field_validation: str = "Warn"  # Strict | Warn | Ignore (kubectl sends Strict)
    warnings: list[str] = field(default_factory=list)


class Store:
    def __init__(self, history: int = 10_000) -> None:
        self.rv = 0
        self.types: dict[tuple[str, str, str], ResourceType] = {}  # (group, version, plural)
        self.objects: dict[str, dict[Key, Obj]] = defaultdict(dict)
        self.history: deque[Event] = deque(maxlen=history)
        self.oldest_rv = 0  # a watch may resume from any resourceVersion >= this
        self.watchers: set[Watcher] = set()
        self.pod_logs: dict[Key, str] = {}
        self.schedule_gc: Callable[[], None] = lambda: None  # the server runs GC soon after
        for rt in BUILTIN_TYPES:
            self.types[(rt.group, rt.version, rt.plural)] = rt
        namespaces = self.type("", "v1", "namespaces")
        for name in INITIAL_NAMESPACES:
            self.create(namespaces, "", {"metadata": {"name": name}})

    # --- types --------------------------------------------------------------------------

    def type(self, group: str, version: str, plural: str) -> ResourceType:
        rt = self.types.get((group, version, plural))
        if rt is None:
            raise errors.no_such_resource()
        return rt

    def type_for_key(self, key: str) -> ResourceType | None:
        """The preferred served version of a stored resource."""
        candidates = [rt for rt in self.types.values() if rt.storage_key == key]
        return max(candidates, key=lambda rt: version_priority(rt.version), default=None)

    def groups(self) -> dict[str, list[str]]:
        """Served groups (without the core group) and their versions, preferred first."""
        result: dict[str, set[str]] = defaultdict(set)
        for group, version, _ in self.types:
            if group:
                result[group].add(version)
        return {
            g: sorted(vs, key=version_priority, reverse=True) for g, vs in sorted(result.items())
        }

    def types_in(self, group: str, version: str) -> list[ResourceType]:
        return [rt for (g, v, _), rt in sorted(self.types.items()) if (g, v) == (group, version)]

    # --- reads --------------------------------------------------------------------------

    @staticmethod
    def present(rt: ResourceType, obj: Obj) -> Obj:
        """A copy as served by ``rt``'s version (no conversion, as a CRD with strategy None)."""
        result: Obj = {"apiVersion": rt.api_version, "kind": rt.kind}
        result.update((k, copy.deepcopy(v)) for k, v in obj.items() if k not in result)
        return result

    def _raw(self, rt: ResourceType, namespace: str, name: str) -> Obj:
        obj = self.objects[rt.storage_key].get((namespace if rt.namespaced else "", name))
        if obj is None:
            raise errors.not_found(rt.plural, rt.group, name)
        return obj

    def get(self, rt: ResourceType, namespace: str, name: str) -> Obj:
        return self.present(rt, self._raw(rt, namespace, name))

    def list_objects(self, rt: ResourceType, namespace: str | None) -> list[Obj]:
        """All objects, optionally of one namespace, sorted by (namespace, name)."""
        objs = self.objects[rt.storage_key]
        return [self.present(rt, objs[k]) for k in sorted(objs) if namespace in (None, "", k[0])]

    def find(self, kind: str, namespace: str | None = None) -> list[Obj]:
        """Test helper: every stored object of a kind (e.g. "Pod"), as dicts."""
        result = []
        for rt in {self.type_for_key(rt.storage_key) for rt in self.types.values()}:
            if rt is not None and rt.kind == kind:
                result.extend(self.list_objects(rt, namespace))
        return result

    # --- create -------------------------------------------------------------------------

    def create(
        self, rt: ResourceType, namespace: str, body: Any, opts: WriteOptions | None = None
    ) -> Obj:
        opts = opts or WriteOptions()
        obj = self._check_body(rt, body)
        meta = obj["metadata"]
        namespace = self._check_namespace(rt, namespace, meta)
        if not meta.get("name"):
            if not meta.get("generateName"):
                self._invalid(
                    rt,
                    "",
                    "metadata.name",
                    "FieldValueRequired",
                    "name or generateName is required",
                )
            meta["name"] = self._generate_name(rt, namespace, meta["generateName"])
        name = meta["name"]
        self._check_name(rt, name)
        if (namespace, name) in self.objects[rt.storage_key]:
            raise errors.already_exists(rt.plural, rt.group, name)
        if rt.namespaced:
            ns = self.objects["namespaces"].get(("", namespace))
            if ns is None:
                raise errors.not_found("namespaces", "", namespace)
            if ns["metadata"].get("deletionTimestamp"):
                raise errors.forbidden(
                    f'{rt.plural}{"." + rt.group if rt.group else ""} "{name}" is forbidden: '
                    f"unable to create new content in namespace {namespace} because it is being "
                    "terminated"
                )
        for key in (*_SYSTEM_META, "resourceVersion", "managedFields", "selfLink"):
            meta.pop(key, None)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=now())
        if rt.tracks_generation:
            meta["generation"] = 1
        if rt.status:
            obj.pop("status", None)  # create cannot set the status of such resources
        self._prepare_create(rt, obj)
        obj = self._admit(rt, obj, None, opts)
        if opts.dry_run:
            return self.present(rt, obj)
        self._write(rt, obj, "ADDED", None)
        if rt.kind == "CustomResourceDefinition":
            self._serve_crd(obj)
        if meta.get("ownerReferences"):
            self.schedule_gc()
        return self.present(rt, obj)

    def _check_body(self, rt: ResourceType, body: Any) -> Obj:
        if not isinstance(body, dict):
            raise errors.bad_request("the body of the request must be a JSON object")
        obj = copy.deepcopy(body)
        if not isinstance(obj.setdefault("metadata", {}), dict):
            raise errors.bad_request("metadata must be an object")
        if obj.get("apiVersion", rt.api_version) != rt.api_version:
            raise errors.bad_request(
                f"the API version in the data ({obj['apiVersion']}) does not match the expected "
                f"API version ({rt.api_version})"
            )
        if obj.get("kind", rt.kind) != rt.kind:
            raise errors.bad_request(
                f"the kind in the data ({obj['kind']}) does not match the expected kind ({rt.kind})"
            )
        obj["apiVersion"], obj["kind"] = rt.api_version, rt.kind
        for empty in ("labels", "annotations", "finalizers", "ownerReferences"):
            if obj["metadata"].get(empty) in ({}, [], None):
                obj["metadata"].pop(empty, None)  # omitted when empty, as the real server does
        for field_name in ("labels", "annotations"):
            values = obj["metadata"].get(field_name)
            if values is not None and not (
                isinstance(values, dict) and all(isinstance(v, str) for v in values.values())
            ):
                raise errors.bad_request(f"metadata.{field_name} must be a map of strings")
        return obj

    def _check_namespace(self, rt: ResourceType, namespace: str, meta: Obj) -> str:
        if not rt.namespaced:
            meta.pop("namespace", None)
            return ""
        body_ns = meta.get("namespace")
        if body_ns and namespace and body_ns != namespace:
            raise errors.bad_request(
                "the namespace of the provided object does not match the namespace sent on "
                "the request"
            )
        namespace = namespace or body_ns or ""
        if not namespace:
            raise errors.bad_request("a namespace is required for a namespaced resource")
        meta["namespace"] = namespace
        return namespace

    def _check_name(self, rt: ResourceType, name: str) -> None:
        if rt.group == "rbac.authorization.k8s.io":
            ok = "/" not in name and "%" not in name and name not in (".", "..")
            rule = "may not contain '/' or '%'"
        elif rt.plural in ("namespaces", "services"):
            ok = len(name) <= 63 and bool(_DNS_LABEL.fullmatch(name))
            rule = "a lowercase RFC 1123 label must consist of lower case alphanumerics or '-'"
        else:
            ok = len(name) <= 253 and bool(_DNS_SUBDOMAIN.fullmatch(name))
            rule = (
                "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric "
                "characters, '-' or '.', and must start and end with an alphanumeric character"
            )
        if not ok:
            self._invalid(rt, name, "metadata.name", "FieldValueInvalid", rule, name)

    def _generate_name(self, rt: ResourceType, namespace: str, prefix: str) -> str:
        alphabet = "".join(c for c in string.ascii_lowercase + string.digits if c not in "aeiou013")
        while True:
            name = prefix + "".join(random.choice(alphabet) for _ in range(5))
            if (namespace, name) not in self.objects[rt.storage_key]:
                return name

    @staticmethod
    def _invalid(
        rt: ResourceType, name: str, path: str, kind: str, detail: str, value: Any = None
    ) -> None:
        raise errors.invalid(rt.kind, rt.group, name, [FieldError(path, kind, detail, value)])

    def _prepare_create(self, rt: ResourceType, obj: Obj) -> None:
        """Per-kind defaults the real registry strategies set on create."""
        if rt.storage_key == "pods":
            obj["status"] = {"phase": "Pending"}
            obj.setdefault("spec", {}).setdefault("restartPolicy", "Always")
        elif rt.storage_key == "namespaces":
            obj["spec"] = {"finalizers": ["kubernetes"]}
            obj["status"] = {"phase": "Active"}
        elif rt.kind == "CustomResourceDefinition":
            obj["status"] = crds.status(obj, now())

    # --- admission: schema, CEL, CRD checks -----------------------------------------------

    def _admit(self, rt: ResourceType, obj: Obj, old: Obj | None, opts: WriteOptions) -> Obj:
        name = obj["metadata"].get("name", "")
        if rt.kind == "CustomResourceDefinition":
            problems = crds.check(obj)
            if problems:
                raise errors.invalid(rt.kind, rt.group, name, problems)
        if rt.custom and rt.schema is not None:
            obj, dropped = schema.prune(obj, rt.schema)
            if dropped and opts.field_validation == "Strict":
                unknown = ", ".join(f'unknown field "{p}"' for p in dropped)
                raise errors.bad_request(f"strict decoding error: {unknown}")
            if dropped and opts.field_validation == "Warn":
                opts.warnings.extend(f'unknown field "{p}"' for p in dropped)
            obj = schema.apply_defaults(obj, rt.schema)
            problems = schema.validate(obj, rt.schema, old)
            if problems:
                raise errors.invalid(rt.kind, rt.group, name, problems)
        return obj

    def _serve_crd(self, crd: Obj) -> None:
        new_types = types_from_crd(crd)
        key = new_types[0].storage_key if new_types else None
        for ident, rt in list(self.types.items()):
            if rt.custom and rt.storage_key == key:
                del self.types[ident]
        for rt in new_types:
            self.types[(rt.group, rt.version, rt.plural)] = rt

    def _unserve_crd(self, crd: Obj) -> None:
        spec = crd.get("spec") or {}
        key = f"{(spec.get('names') or {}).get('plural')}.{spec.get('group')}"
        for ident, rt in list(self.types.items()):
            if rt.custom and rt.storage_key == key:
                del self.types[ident]
        self.objects.pop(key, None)

    # --- update & patch -----------------------------------------------------------------

    def replace(
        self,
        rt: ResourceType,
        namespace: str,
        name: str,
        body: Any,
        subresource: str | None = None,
        opts: WriteOptions | None = None,
    ) -> Obj:
        """PUT: a full object; its metadata.resourceVersion, if set, must be the current one."""
        old = self._raw(rt, namespace, name)
        if subresource == "scale":
            return self._write_scale(rt, old, body, opts or WriteOptions())
        new = self._check_body(rt, body)
        if new["metadata"].get("name", name) != name:
            raise errors.bad_request(
                f"the name of the object ({new['metadata']['name']}) does not match the name on "
                f"the URL ({name})"
            )
        rv = new["metadata"].get("resourceVersion")
        if rv and rv != old["metadata"]["resourceVersion"]:
            raise errors.stale(rt.plural, rt.group, name)
        if not rv and rt.custom:
            self._invalid(
                rt,
                name,
                "metadata.resourceVersion",
                "FieldValueInvalid",
                "must be specified for an update",
                0,
            )
        return self._update(rt, old, new, subresource, opts or WriteOptions())

    def patch(
        self,
        rt: ResourceType,
        namespace: str,
        name: str,
        patch_type: str,
        body: Any,
        subresource: str | None = None,
        opts: WriteOptions | None = None,
    ) -> Obj:
        """PATCH of type ``json``, ``merge``, ``strategic`` or ``apply`` (approximated)."""
        opts = opts or WriteOptions()
        if (
            patch_type == "apply"
            and (namespace if rt.namespaced else "", name) not in self.objects[rt.storage_key]
        ):
            if not isinstance(body, dict):
                raise errors.bad_request("an apply patch must be an object")
            return self.create(
                rt,
                namespace,
                {**body, "metadata": {**(body.get("metadata") or {}), "name": name}},
                opts,
            )
        old = self._raw(rt, namespace, name)
        base = self._scale_of(rt, old) if subresource == "scale" else self.present(rt, old)
        try:
            if patch_type == "json":
                patched = json_patch(base, body)
            elif patch_type == "merge":
                patched = merge_patch(base, body)
            else:  # strategic, apply
                patched = strategic_merge_patch(base, body)
        except PatchError as exc:
            raise ApiError(
                422,
                "Invalid",
                f"the server rejected our request due to an error in our request: {exc}",
            ) from exc
        if subresource == "scale":
            return self._write_scale(rt, old, patched, opts)
        new = self._check_body(rt, patched)
        rv = new["metadata"].get("resourceVersion")
        if rv and rv != old["metadata"]["resourceVersion"]:
            raise errors.stale(rt.plural, rt.group, name)
        return self._update(rt, old, new, subresource, opts)

    def _update(
        self, rt: ResourceType, old: Obj, new: Obj, subresource: str | None, opts: WriteOptions
    ) -> Obj:
        old_meta = old["metadata"]
        name = old_meta["name"]
        if subresource == "status":
            status = new.get("status")
            new = copy.deepcopy(old)
            if status is None:
                new.pop("status", None)
            else:
                new["status"] = status
        elif rt.status:
            if "status" in old:
                new["status"] = copy.deepcopy(old["status"])
            else:
                new.pop("status", None)
        meta = new["metadata"]
        meta["name"] = name
        if rt.namespaced:
            meta["namespace"] = old_meta["namespace"]
        else:
            meta.pop("namespace", None)
        for key in _SYSTEM_META:
            if key in old_meta:
                meta[key] = old_meta[key]
            else:
                meta.pop(key, None)
        meta.pop("managedFields", None)
        meta["resourceVersion"] = old_meta["resourceVersion"]
        if old_meta.get("deletionTimestamp"):
            added = [
                f
                for f in meta.get("finalizers") or []
                if f not in (old_meta.get("finalizers") or [])
            ]
            if added:
                self._invalid(
                    rt,
                    name,
                    "metadata.finalizers",
                    "FieldValueForbidden",
                    "no new finalizers can be added if the object is being deleted, "
                    f"found new finalizers {added}",
                )
        new = self._admit(rt, new, old, opts)
        if rt.tracks_generation and _content(new, rt.status) != _content(old, rt.status):
            new["metadata"]["generation"] = old_meta.get("generation", 0) + 1
        if new == old:
            return self.present(rt, old)  # a no-op: no new resourceVersion, no event
        if opts.dry_run:
            return self.present(rt, new)
        released = new["metadata"].get("deletionTimestamp") and not new["metadata"].get(
            "finalizers"
        )
        if released and rt.storage_key != "namespaces":  # namespaces: see _finish_deletion
            return self.present(rt, self._remove(rt, new))
        self._write(rt, new, "MODIFIED", old)
        if rt.kind == "CustomResourceDefinition":
            self._serve_crd(new)
        self.schedule_gc()
        return self.present(rt, new)

    # --- scale subresource --------------------------------------------------------------

    def _scale_of(self, rt: ResourceType, obj: Obj) -> Obj:
        if rt.scale is None:
            raise errors.not_found(rt.plural + "/scale", rt.group, obj["metadata"]["name"])
        meta = obj["metadata"]
        status: Obj = {"replicas": jsonpath.get(obj, rt.scale.status_replicas) or 0}
        if rt.scale.selector_from_spec:
            selector = jsonpath.get(obj, ".spec.selector")
            if isinstance(selector, dict):
                status["selector"] = selector_to_string(selector)
        elif rt.scale.label_selector:
            selector = jsonpath.get(obj, rt.scale.label_selector)
            if selector:
                status["selector"] = selector
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {
                k: meta[k]
                for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                if k in meta
            },
            "spec": {"replicas": jsonpath.get(obj, rt.scale.spec_replicas) or 0},
            "status": status,
        }

    def get_scale(self, rt: ResourceType, namespace: str, name: str) -> Obj:
        return self._scale_of(rt, self._raw(rt, namespace, name))

    def _write_scale(self, rt: ResourceType, old: Obj, scale: Any, opts: WriteOptions) -> Obj:
        name = old["metadata"]["name"]
        if rt.scale is None:
            raise errors.not_found(rt.plural + "/scale", rt.group, name)
        if not isinstance(scale, dict):
            raise errors.bad_request("a Scale must be an object")
        rv = (scale.get("metadata") or {}).get("resourceVersion")
        if rv and rv != old["metadata"]["resourceVersion"]:
            raise errors.stale(rt.plural, rt.group, name)
        replicas = (scale.get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            raise errors.invalid(
                "Scale",
                "autoscaling",
                name,
                [
                    FieldError(
                        "spec.replicas",
                        "FieldValueInvalid",
                        "must be greater than or equal to 0",
                        replicas,
                    )
                ],
            )
        new = copy.deepcopy(old)
        jsonpath.put(new, rt.scale.spec_replicas, replicas)
        updated = self._update(rt, old, new, None, opts)
        return self._scale_of(rt, updated)

    # --- delete -------------------------------------------------------------------------

    def delete(
        self,
        rt: ResourceType,
        namespace: str,
        name: str,
        options: Obj | None = None,
        dry_run: bool = False,
    ) -> Obj:
        """DELETE with DeleteOptions (propagationPolicy, preconditions); see module docs."""
        options = options or {}
        old = self._raw(rt, namespace, name)
        preconditions = options.get("preconditions") or {}
        for key in ("uid", "resourceVersion"):
            wanted = preconditions.get(key)
            if wanted and wanted != old["metadata"].get(key):
                raise errors.conflict(
                    rt.plural,
                    rt.group,
                    name,
                    f"Precondition failed: {key} in precondition: {wanted}, {key} in object meta: "
                    f"{old['metadata'].get(key)}",
                )
        if dry_run:
            return self.present(rt, old)
        policy = options.get("propagationPolicy") or (
            "Orphan" if options.get("orphanDependents") else "Background"
        )
        return self.present(rt, self._delete_obj(rt, old, policy))

    def _delete_obj(self, rt: ResourceType, old: Obj, policy: str) -> Obj:
        meta = old["metadata"]
        if meta.get("deletionTimestamp"):
            return old  # already being deleted
        if policy == "Orphan":
            self._orphan_dependents(meta["uid"])
        finalizers = list(meta.get("finalizers") or [])
        if policy == "Foreground" and FOREGROUND not in finalizers:
            finalizers.append(FOREGROUND)
        if rt.kind == "CustomResourceDefinition" and CRD_CLEANUP not in finalizers:
            finalizers.append(CRD_CLEANUP)
        if finalizers or rt.storage_key == "namespaces":
            new = copy.deepcopy(old)
            new["metadata"].update(deletionTimestamp=now(), deletionGracePeriodSeconds=0)
            if finalizers:
                new["metadata"]["finalizers"] = finalizers
            if rt.storage_key == "namespaces":
                new["status"] = {"phase": "Terminating"}
            self._write(rt, new, "MODIFIED", old)
            self.schedule_gc()
            return new
        return self._remove(rt, old)

    def _remove(self, rt: ResourceType, last: Obj) -> Obj:
        final = copy.deepcopy(last)
        meta = final["metadata"]
        self.rv += 1
        meta["resourceVersion"] = str(self.rv)
        del self.objects[rt.storage_key][(meta.get("namespace", ""), meta["name"])]
        self.pod_logs.pop((meta.get("namespace", ""), meta["name"]), None)
        self._emit(Event(self.rv, rt.storage_key, "DELETED", final, last))
        if rt.kind == "CustomResourceDefinition":
            self._unserve_crd(final)
        self.schedule_gc()
        return final

    def _orphan_dependents(self, uid: str) -> None:
        for rt, obj in self._all():
            refs = obj["metadata"].get("ownerReferences") or []
            if any(ref.get("uid") == uid for ref in refs):
                new = copy.deepcopy(obj)
                new["metadata"]["ownerReferences"] = [r for r in refs if r.get("uid") != uid]
                if not new["metadata"]["ownerReferences"]:
                    del new["metadata"]["ownerReferences"]
                self._write(rt, new, "MODIFIED", obj)

    # --- garbage collection and cleanup "controllers" -----------------------------------

    def collect_garbage(self) -> None:
        """Delete dependents whose owners are all gone; finish namespace, CRD and foreground
        deletions. Repeats until nothing changes (cascades go level by level)."""
        while self._gc_pass():
            pass

    def _gc_pass(self) -> bool:
        rv_before = self.rv
        live = {obj["metadata"]["uid"] for _, obj in self._all()}
        for rt, obj in self._all():
            current = self.objects[rt.storage_key].get(_key(obj))
            if current is not obj:
                continue  # changed or removed earlier in this pass
            meta = obj["metadata"]
            if meta.get("deletionTimestamp"):
                self._finish_deletion(rt, obj)
                continue
            owners = [ref.get("uid") for ref in meta.get("ownerReferences") or []]
            if owners and not any(uid in live for uid in owners):
                self._delete_obj(rt, obj, "Background")
        return self.rv != rv_before

    def _finish_deletion(self, rt: ResourceType, obj: Obj) -> None:
        meta = obj["metadata"]
        finalizers = list(meta.get("finalizers") or [])
        if rt.storage_key == "namespaces":
            contents = [
                (t, o)
                for t, o in self._all()
                if t.namespaced and o["metadata"]["namespace"] == meta["name"]
            ]
            self._delete_all(contents)
            if not contents and not finalizers:
                self._remove(rt, obj)
            return
        if CRD_CLEANUP in finalizers:
            key = f"{obj['spec']['names']['plural']}.{obj['spec']['group']}"
            contents = [(t, o) for t, o in self._all() if t.storage_key == key]
            self._delete_all(contents)
            if not contents:
                self._drop_finalizer(rt, obj, CRD_CLEANUP)
            return
        if FOREGROUND in finalizers:
            dependents = [
                (t, o)
                for t, o in self._all()
                if any(
                    r.get("uid") == meta["uid"] for r in o["metadata"].get("ownerReferences") or []
                )
            ]
            self._delete_all(dependents)
            if not dependents:
                self._drop_finalizer(rt, obj, FOREGROUND)

    def _delete_all(self, objs: Iterable[tuple[ResourceType, Obj]]) -> None:
        for rt, obj in objs:
            if not obj["metadata"].get("deletionTimestamp"):
                self._delete_obj(rt, obj, "Background")

    def _drop_finalizer(self, rt: ResourceType, obj: Obj, finalizer: str) -> None:
        new = copy.deepcopy(obj)
        new["metadata"]["finalizers"] = [f for f in obj["metadata"]["finalizers"] if f != finalizer]
        if not new["metadata"]["finalizers"]:
            del new["metadata"]["finalizers"]
            self._remove(rt, new)
        else:
            self._write(rt, new, "MODIFIED", obj)

    def _all(self) -> list[tuple[ResourceType, Obj]]:
        result: list[tuple[ResourceType, Obj]] = []
        for key, objs in list(self.objects.items()):
            rt = self.type_for_key(key)
            if rt is not None:
                result.extend((rt, obj) for obj in list(objs.values()))
        return result

    # --- writes, events, watches --------------------------------------------------------

    def _write(self, rt: ResourceType, obj: Obj, kind: str, old: Obj | None) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.objects[rt.storage_key][_key(obj)] = obj
        self._emit(Event(self.rv, rt.storage_key, kind, obj, old))

    def _emit(self, event: Event) -> None:
        if len(self.history) == self.history.maxlen:
            self.oldest_rv = self.history[0].rv
        self.history.append(event)
        for watcher in self.watchers:
            if watcher.wants(event):
                watcher.queue.put_nowait(event)

    def compact(self) -> None:
        """Forget the event history (as etcd compaction): older resourceVersions get 410."""
        self.history.clear()
        self.oldest_rv = self.rv

    def watch(
        self, rt: ResourceType, namespace: str | None, resource_version: str | None
    ) -> tuple[list[Event], Watcher]:
        """Subscribe; returns the events to send first and the live subscription.

        With no (or "0") resourceVersion the first events are the current objects as ADDED;
        otherwise the recorded events after that resourceVersion (410 Gone when compacted).
        """
        watcher = Watcher(rt.storage_key, namespace or None)
        if resource_version in (None, "", "0"):
            initial = [
                Event(self.rv, rt.storage_key, "ADDED", obj, None)
                for key, obj in sorted(self.objects[rt.storage_key].items())
                if watcher.namespace in (None, key[0])
            ]
        else:
            try:
                since = int(resource_version)
            except ValueError as exc:
                raise errors.bad_request(f"invalid resourceVersion {resource_version!r}") from exc
            if since < self.oldest_rv:
                raise errors.gone(f"too old resource version: {since} ({self.oldest_rv + 1})")
            initial = [e for e in self.history if e.rv > since and watcher.wants(e)]
        self.watchers.add(watcher)
        return initial, watcher

    def unwatch(self, watcher: Watcher) -> None:
        self.watchers.discard(watcher)


def _key(obj: Obj) -> Key:
    return (obj["metadata"].get("namespace", ""), obj["metadata"]["name"])


def _content(obj: Obj, without_status: bool) -> Obj:
    """What the generation tracks: everything but metadata (and status, for subresources)."""
    return {
        k: v for k, v in obj.items() if k != "metadata" and not (without_status and k == "status")
    }
