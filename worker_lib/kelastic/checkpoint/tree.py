"""The state dict's structure as bounded JSON: the manifest's ``tree`` (no pickle).

A state dict (torch's ``module.state_dict()``, ``optimizer.state_dict()``, or any nest of
them with plain values) is encoded as JSON where every container is an array whose first
element is a tag, and every tensor a reference into the payload:

=========================  =======================================================
Python value               JSON
=========================  =======================================================
``None``, bool, str        itself
int (within +-(2**63-1))   itself
float, finite              itself (``1.0``: a JSON number with a point, read as float)
float, NaN or infinite     ``["f", "nan" | "inf" | "-inf"]``
list / tuple               ``["l", item, ...]`` / ``["t", item, ...]``
dict                       ``["d", key, value, key, value, ...]`` (keys: None, bool,
                           int, float, str, or a tuple of them: an optimizer's state
                           is keyed by int)
OrderedDict                ``["o", metadata, key, value, ...]``: torch's
                           ``state_dict._metadata`` (versions of each module) or null
tensor                     ``["T", index]``: the index-th tensor of the manifest
=========================  =======================================================

:func:`flatten` takes a predicate for tensors, so this module imports no torch; anything
else (a ``torch.device``, an ndarray, a set, a custom object) raises :class:`TreeError`
naming where it is in the state dict. :func:`check_tree` is the reader's bound: it walks
an already bounded-decoded value (depth at most :data:`MAX_TREE_DEPTH`) and refuses an
unknown tag, a malformed node, an unhashable key, or a tensor index out of range or used
twice. Stdlib only.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Final

__all__ = [
    "MAX_INT",
    "MAX_TREE_DEPTH",
    "TreeError",
    "build",
    "check_tree",
    "flatten",
    "pair_tensors",
]

#: Deepest nesting of containers in a state dict.
MAX_TREE_DEPTH: Final = 32
#: Largest magnitude of an int (the bounded decoder reads at most 19 digits).
MAX_INT: Final = 2**63 - 1
_FLOATS: Final = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_KEY_SCALARS: Final = (str, int, float, type(None))


class TreeError(ValueError):
    """A value the tree cannot hold (writer), or a tree no writer produced (reader)."""


def _float(value: float) -> Any:
    if math.isfinite(value):
        return value
    return ["f", "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")]


def flatten(obj: Any, is_tensor: Callable[[Any], bool]) -> tuple[Any, list[Any]]:
    """Encode ``obj`` as a tree (see the module doc) and list its tensors in order.

    Args:
        obj: a state dict: dicts, lists, tuples, tensors and plain values.
        is_tensor: whether a leaf is a tensor (checked before any other type).

    Returns:
        ``(tree, tensors)``: the JSON-ready tree and the tensors it references by index.

    Raises:
        TreeError: an unsupported type, an int past +-(2**63-1), a key that is not a plain
            value, or nesting deeper than :data:`MAX_TREE_DEPTH` (a cycle too); the message
            names the path (``state['optim']['state'][0]``).
    """
    tensors: list[Any] = []

    def enc(value: Any, path: str, depth: int, key: bool = False) -> Any:
        if depth > MAX_TREE_DEPTH:
            raise TreeError(f"{path}: nested deeper than {MAX_TREE_DEPTH} (or a cycle)")
        try:
            tensor = not key and is_tensor(value)
        except TreeError as exc:
            raise TreeError(f"{path}: {exc}") from None
        if tensor:
            tensors.append(value)
            return ["T", len(tensors) - 1]
        if value is None or isinstance(value, bool | str):
            return value
        if isinstance(value, int):
            if abs(value) > MAX_INT:
                raise TreeError(f"{path}: int {value} is past +-(2**63-1)")
            return int(value)
        if isinstance(value, float):
            return _float(float(value))
        if isinstance(value, tuple):
            return ["t", *(enc(v, f"{path}[{i}]", depth + 1, key) for i, v in enumerate(value))]
        if key:
            raise TreeError(f"{path}: a key must be None, bool, int, float, str or a tuple")
        if isinstance(value, list):
            return ["l", *(enc(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))]
        if isinstance(value, dict):
            if isinstance(value, OrderedDict):
                meta = getattr(value, "_metadata", None)
                node: list[Any] = ["o", None if meta is None else enc(meta, path, depth + 1)]
            else:
                node = ["d"]
            for k, v in value.items():
                node.append(enc(k, f"{path} key {k!r:.40}", depth + 1, key=True))
                node.append(enc(v, f"{path}[{k!r:.40}]", depth + 1))
            return node
        raise TreeError(
            f"{path}: cannot store a {type(value).__module__}.{type(value).__qualname__} "
            "(no pickle: tensors, dicts, lists, tuples, str, int, float, bool, None)"
        )

    return enc(obj, "state", 0), tensors


def _check(node: Any, count: int, seen: bytearray, depth: int, key: bool) -> None:
    if node is None or isinstance(node, bool | str | float):
        return
    if isinstance(node, int):
        if abs(node) > MAX_INT:
            raise TreeError(f"int {node} is past +-(2**63-1)")
        return
    if not isinstance(node, list) or not node or not isinstance(node[0], str):
        raise TreeError(f"a node must be a scalar or a tagged list, got {node!r:.60}")
    if depth > MAX_TREE_DEPTH:
        raise TreeError(f"nested deeper than {MAX_TREE_DEPTH}")
    tag, rest = node[0], node[1:]
    if tag == "f":
        if rest not in (["nan"], ["inf"], ["-inf"]):
            raise TreeError(f"bad float node {node!r:.60}")
    elif tag == "T":
        if key or len(rest) != 1 or not isinstance(rest[0], int) or isinstance(rest[0], bool):
            raise TreeError(f"bad tensor node {node!r:.60}")
        if not 0 <= rest[0] < count or seen[rest[0]]:
            raise TreeError(f"tensor {rest[0]} is not one of {count}, or is used twice")
        seen[rest[0]] = 1
    elif tag == "t" or (tag == "l" and not key):
        for item in rest:
            _check(item, count, seen, depth + 1, key)
    elif tag in ("d", "o") and not key:
        pairs = rest[1:] if tag == "o" else rest
        if tag == "o" and rest[:1] != [None]:
            if not rest or not (isinstance(rest[0], list) and rest[0][:1] in (["d"], ["o"])):
                raise TreeError("an OrderedDict's metadata must be null or a dict")
            _check(rest[0], 0, seen, depth + 1, False)
        if len(pairs) % 2:
            raise TreeError(f"a {tag!r} node has a key without a value")
        for index, item in enumerate(pairs):
            _check(item, count, seen, depth + 1, key=index % 2 == 0)
    else:
        raise TreeError(f"unknown or misplaced tag {tag!r:.20}" + (" in a key" if key else ""))


def check_tree(tree: Any, count: int) -> None:
    """Check a decoded tree referencing ``count`` tensors: each exactly once.

    Raises:
        TreeError: an unknown tag, a malformed node, a key that is not hashable, a
            tensor index out of range or used twice, or one never used.
    """
    seen = bytearray(count)
    _check(tree, count, seen, 0, False)
    if count and not all(seen):
        raise TreeError(f"tensor {seen.index(0)} is never used")


def build(tree: Any, tensors: Sequence[Any]) -> Any:
    """Rebuild the state dict from a tree :func:`check_tree` accepted and its tensors."""
    if not isinstance(tree, list):
        return tree
    tag, rest = tree[0], tree[1:]
    if tag == "T":
        return tensors[rest[0]]
    if tag == "f":
        return _FLOATS[rest[0]]
    if tag == "l":
        return [build(v, tensors) for v in rest]
    if tag == "t":
        return tuple(build(v, tensors) for v in rest)
    out: dict[Any, Any]
    if tag == "o":
        out = OrderedDict()
        if rest[0] is not None:
            out._metadata = build(rest[0], tensors)  # type: ignore[attr-defined]
        rest = rest[1:]
    else:
        out = {}
    for index in range(0, len(rest), 2):
        out[build(rest[index], tensors)] = build(rest[index + 1], tensors)
    return out


def pair_tensors(saved: Any, into: Any) -> dict[int, int]:
    """Which tensor of the tree ``into`` lies where each tensor of the tree ``saved`` does
    (both encoded by :func:`flatten`; ``saved`` checked by :func:`check_tree`): saved
    index -> ``into`` index, for every tensor reached through the same dict keys (in any
    order), list or tuple positions and containers of the same kind in both. A place
    that differs (a key missing, a list where a dict was, a shorter list) pairs nothing
    under it. Depth is bounded by the trees' own (:data:`MAX_TREE_DEPTH`)."""
    out: dict[int, int] = {}

    def walk(a: Any, b: Any, depth: int) -> None:
        if depth > MAX_TREE_DEPTH + 2 or not (isinstance(a, list) and isinstance(b, list)):
            return
        if not a or not b or a[0] != b[0]:
            return
        tag = a[0]
        if tag == "T":
            out[a[1]] = b[1]
        elif tag in ("l", "t"):
            for x, y in zip(a[1:], b[1:], strict=False):
                walk(x, y, depth + 1)
        elif tag in ("d", "o"):
            start = 1 if tag == "d" else 2
            theirs = {
                json.dumps(k): v for k, v in zip(b[start::2], b[start + 1 :: 2], strict=False)
            }
            for k, v in zip(a[start::2], a[start + 1 :: 2], strict=False):
                other = theirs.get(json.dumps(k))
                if other is not None:
                    walk(v, other, depth + 1)

    walk(saved, into, 0)
    return out
