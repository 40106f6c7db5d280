"""Label selectors (``=``, ``==``, ``!=``, ``in``, ``notin``, exists, ``!``exists) and
field selectors (``=``, ``==``, ``!=`` on any dotted field path)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from .errors import bad_request

Obj = Mapping[str, Any]
Matcher = Callable[[Obj], bool]

_KEY = r"[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?"
_VALUE = r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?"


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside parentheses."""
    parts: list[str] = []
    depth = 0
    current = ""
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


def _labels(obj: Obj) -> Mapping[str, str]:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return labels if isinstance(labels, Mapping) else {}


def _requirement(term: str) -> Matcher:
    set_match = re.fullmatch(r"(\S+)\s+(in|notin)\s+\((.*)\)", term)
    if set_match:
        key, op, raw = set_match.groups()
        values = {v.strip() for v in raw.split(",") if v.strip()}
        _check(key, _KEY, term)
        for value in values:
            _check(value, _VALUE, term)
        if op == "in":
            return lambda obj: _labels(obj).get(key) in values
        return lambda obj: _labels(obj).get(key) not in values
    eq_match = re.fullmatch(r"([^=!\s]+)\s*(==|=|!=)\s*(\S*)", term)
    if eq_match:
        key, op, value = eq_match.groups()
        _check(key, _KEY, term)
        _check(value, _VALUE, term)
        if op == "!=":
            return lambda obj: _labels(obj).get(key) != value
        return lambda obj: _labels(obj).get(key) == value
    if term.startswith("!"):
        key = term[1:].strip()
        _check(key, _KEY, term)
        return lambda obj: key not in _labels(obj)
    _check(term, _KEY, term)
    return lambda obj: term in _labels(obj)


def _check(token: str, pattern: str, term: str) -> None:
    if not re.fullmatch(pattern, token):
        raise bad_request(f'unable to parse requirement: invalid label selector term "{term}"')


def label_selector(text: str | None) -> Matcher:
    """Compile ``?labelSelector=``; an empty selector matches everything."""
    if not text:
        return lambda obj: True
    matchers = [_requirement(term) for term in _split_top_level(text)]
    return lambda obj: all(m(obj) for m in matchers)


def label_selector_from_dict(selector: Mapping[str, Any]) -> Matcher:
    """Compile a structured ``LabelSelector`` (matchLabels + matchExpressions)."""
    return label_selector(selector_to_string(selector))


def selector_to_string(selector: Mapping[str, Any]) -> str:
    """Render a structured ``LabelSelector`` as its string form (used by the scale subresource)."""
    terms = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In":
            terms.append(f"{key} in ({','.join(values)})")
        elif op == "NotIn":
            terms.append(f"{key} notin ({','.join(values)})")
        elif op == "Exists":
            terms.append(key)
        elif op == "DoesNotExist":
            terms.append(f"!{key}")
    return ",".join(terms)


def field_value(obj: Obj, path: str) -> str:
    """The string value of a dotted field path; ``""`` when absent (as the real server)."""
    node: Any = obj
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return ""
        node = node[part]
    if isinstance(node, bool):
        return "true" if node else "false"
    return "" if node is None else str(node)


def field_selector(text: str | None) -> Matcher:
    """Compile ``?fieldSelector=``: any dotted path, e.g. ``metadata.name=x,status.phase!=Failed``.

    The real server allows only a per-resource list of fields; the emulator allows any path.
    """
    if not text:
        return lambda obj: True
    matchers: list[Matcher] = []
    for term in _split_top_level(text):
        match = re.fullmatch(r"([A-Za-z0-9_.]+)\s*(==|=|!=)\s*(.*)", term)
        if not match:
            raise bad_request(f'invalid field selector: "{term}"')
        matchers.append(_field_term(*match.groups()))
    return lambda obj: all(m(obj) for m in matchers)


def _field_term(path: str, op: str, value: str) -> Matcher:
    if op == "!=":
        return lambda obj: field_value(obj, path) != value
    return lambda obj: field_value(obj, path) == value
