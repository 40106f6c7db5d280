"""The PATCH bodies the API server accepts: JSON merge patch (RFC 7386), an approximation of
strategic merge patch, and JSON patch (RFC 6902).

Strategic merge: maps merge, ``null`` deletes, lists are replaced except the well-known
Kubernetes lists that merge by a key (containers/env/volumes by ``name``, volumeMounts by
``mountPath``, container ports by ``containerPort``, service ports by ``port``, conditions by
``type``, ownerReferences by ``uid``) and ``metadata.finalizers`` (a set union). Directives
``$patch: replace|delete``, ``$retainKeys``, ``$deleteFromPrimitiveList/<f>`` are honoured;
``$setElementOrder/<f>`` is dropped.
"""

from __future__ import annotations

import copy
from typing import Any

JSON = Any


class PatchError(Exception):
    """A patch that cannot be applied (the server answers 422)."""


def merge_patch(target: JSON, patch: JSON) -> JSON:
    """RFC 7386: a non-object patch replaces; ``null`` members delete."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# field name -> merge key; "ports" depends on where it is (see _merge_key).
_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "imagePullSecrets": "name",
    "hostAliases": "ip",
    "conditions": "type",
    "ownerReferences": "uid",
    "resourceClaims": "name",
    "topologySpreadConstraints": "topologyKey",
}
_PRIMITIVE_SETS = {"finalizers"}


def _merge_key(path: tuple[str, ...]) -> str | None:
    field = path[-1]
    if field == "ports":
        in_container = any(
            p in ("containers", "initContainers", "ephemeralContainers") for p in path
        )
        return "containerPort" if in_container else "port"
    return _MERGE_KEYS.get(field)


def strategic_merge_patch(target: JSON, patch: JSON) -> JSON:
    """Apply a strategic merge patch (the approximation described in the module docstring)."""
    return _smp(target, patch, ())


def _smp(target: JSON, patch: JSON, path: tuple[str, ...]) -> JSON:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    patch = dict(patch)
    directive = patch.pop("$patch", None)
    if directive == "delete":
        return None
    retain = patch.pop("$retainKeys", None)
    if directive == "replace":
        return _strip_directives(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$setElementOrder/"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            if isinstance(result.get(field), list):
                result[field] = [v for v in result[field] if v not in value]
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list):
            merged = _smp_list(result.get(key), value, (*path, key))
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        else:
            merged = _smp(result.get(key), value, (*path, key))
            if merged is None and isinstance(value, dict):
                result.pop(key, None)
            else:
                result[key] = merged
    if isinstance(retain, list):
        result = {k: v for k, v in result.items() if k in retain}
    return result


def _smp_list(target: JSON, patch: list[Any], path: tuple[str, ...]) -> list[Any] | None:
    current = list(target) if isinstance(target, list) else []
    if any(isinstance(i, dict) and i.get("$patch") == "replace" for i in patch):
        return [_strip_directives(i) for i in patch if not (isinstance(i, dict) and "$patch" in i)]
    if path[-1] in _PRIMITIVE_SETS and all(not isinstance(i, (dict, list)) for i in patch):
        return current + [i for i in patch if i not in current]
    key = _merge_key(path)
    if key is None or not all(isinstance(i, dict) for i in patch):
        return [_strip_directives(i) for i in patch]
    result = [copy.deepcopy(i) for i in current]
    for item in patch:
        ident = item.get(key)
        index = next(
            (n for n, old in enumerate(result) if isinstance(old, dict) and old.get(key) == ident),
            None,
        )
        if item.get("$patch") == "delete":
            if index is not None:
                del result[index]
        elif index is None:
            result.append(_strip_directives(item))
        else:
            result[index] = _smp(result[index], item, path)
    return result


def _strip_directives(value: JSON) -> JSON:
    if isinstance(value, dict):
        return {
            k: _strip_directives(v)
            for k, v in value.items()
            if not k.startswith("$") and v is not None
        }
    if isinstance(value, list):
        return [_strip_directives(v) for v in value]
    return value


# --- JSON patch (RFC 6902) -------------------------------------------------------------------


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"invalid JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _parent(doc: JSON, parts: list[str], path: str) -> JSON:
    node = doc
    for part in parts[:-1]:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise PatchError(f"path {path!r} does not exist")
    return node


def _get(doc: JSON, path: str) -> JSON:
    parts = _pointer(path)
    if not parts:
        return doc
    parent = _parent(doc, parts, path)
    last = parts[-1]
    if isinstance(parent, dict) and last in parent:
        return parent[last]
    if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
        return parent[int(last)]
    raise PatchError(f"path {path!r} does not exist")


def _add(doc: JSON, path: str, value: JSON) -> JSON:
    parts = _pointer(path)
    if not parts:
        return value
    parent = _parent(doc, parts, path)
    last = parts[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        if last == "-":
            parent.append(value)
        elif last.isdigit() and int(last) <= len(parent):
            parent.insert(int(last), value)
        else:
            raise PatchError(f"index out of range in {path!r}")
    else:
        raise PatchError(f"path {path!r} does not exist")
    return doc


def _remove(doc: JSON, path: str) -> JSON:
    parts = _pointer(path)
    if not parts:
        raise PatchError("cannot remove the whole document")
    parent = _parent(doc, parts, path)
    last = parts[-1]
    if isinstance(parent, dict) and last in parent:
        del parent[last]
    elif isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
        del parent[int(last)]
    else:
        raise PatchError(f"unable to remove nonexistent key: {path!r}")
    return doc


def json_patch(target: JSON, ops: JSON) -> JSON:
    """Apply RFC 6902 operations; a failed ``test`` raises :class:`PatchError`."""
    if not isinstance(ops, list):
        raise PatchError("a JSON patch must be a list of operations")
    doc = copy.deepcopy(target)
    for op in ops:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise PatchError(f"invalid JSON patch operation: {op!r}")
        kind, path = op["op"], op["path"]
        if kind == "test":
            actual = _get(doc, path)
            if actual != op.get("value"):
                raise PatchError(
                    f"testing value {path} failed: expected {op.get('value')!r}, found {actual!r}"
                )
        elif kind == "add":
            doc = _add(doc, path, copy.deepcopy(op.get("value")))
        elif kind == "remove":
            doc = _remove(doc, path)
        elif kind == "replace":
            _get(doc, path)  # must exist
            value = copy.deepcopy(op.get("value"))
            doc = value if path == "" else _add(_remove(doc, path), path, value)
        elif kind == "move":
            value = _get(doc, op["from"])
            doc = _add(_remove(doc, op["from"]), path, value)
        elif kind == "copy":
            doc = _add(doc, path, copy.deepcopy(_get(doc, op["from"])))
        else:
            raise PatchError(f"unknown JSON patch operation {kind!r}")
    return doc
