"""Structural-schema handling for custom resources, as the API server does on every write:
pruning of unknown fields, defaulting, validation (OpenAPI v3 keywords) and the CEL rules of
``x-kubernetes-validations`` (see :mod:`.cel` for the supported subset)."""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Iterator
from typing import Any

from . import cel
from .errors import FieldError

Schema = dict[str, Any]
_ROOT_KEEP = ("apiVersion", "kind", "metadata")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


# --- pruning --------------------------------------------------------------------------------


def prune(obj: dict[str, Any], schema: Schema) -> tuple[dict[str, Any], list[str]]:
    """Drop fields the schema does not declare; returns the pruned copy and the dropped paths."""
    dropped: list[str] = []
    result = copy.deepcopy(obj)
    kept = {k: result.pop(k) for k in _ROOT_KEEP if k in result}
    pruned = _prune(result, schema, "", dropped)
    return {**kept, **(pruned if isinstance(pruned, dict) else {})}, dropped


def _prune(value: Any, schema: Schema, path: str, dropped: list[str]) -> Any:
    if isinstance(value, dict):
        props: dict[str, Schema] = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        preserve = schema.get("x-kubernetes-preserve-unknown-fields") is True
        embedded = schema.get("x-kubernetes-embedded-resource") is True
        result: dict[str, Any] = {}
        for key, item in value.items():
            if key in props:
                result[key] = _prune(item, props[key], _join(path, key), dropped)
            elif isinstance(extra, dict):
                result[key] = _prune(item, extra, _join(path, key), dropped)
            elif preserve or extra is True or (embedded and key in _ROOT_KEEP):
                result[key] = item
            else:
                dropped.append(_join(path, key))
        return result
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [
            _prune(item, schema["items"], f"{path}[{n}]", dropped) for n, item in enumerate(value)
        ]
    return value


# --- defaulting -----------------------------------------------------------------------------


def apply_defaults(obj: Any, schema: Schema) -> Any:
    """Fill in ``default`` values of absent (or null, non-nullable) properties, recursively."""
    if isinstance(obj, dict):
        props: dict[str, Schema] = schema.get("properties") or {}
        for key, sub in props.items():
            if "default" in sub and (obj.get(key) is None and not sub.get("nullable")):
                obj[key] = copy.deepcopy(sub["default"])
            if key in obj:
                obj[key] = apply_defaults(obj[key], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in list(obj):
                if key not in props:
                    obj[key] = apply_defaults(obj[key], extra)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(item, schema["items"]) for item in obj]
    return obj


# --- validation -----------------------------------------------------------------------------

_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: (
        (isinstance(v, int) and not isinstance(v, bool))
        or (isinstance(v, float) and v.is_integer())
    ),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
}


def _json_type(value: Any) -> str:
    for name in ("boolean", "integer", "number", "string", "array", "object"):
        if _TYPES[name](value):
            return name
    return "null"


def validate(obj: dict[str, Any], schema: Schema, old: dict[str, Any] | None) -> list[FieldError]:
    """Validate a whole custom resource; ``old`` is the stored object on updates."""
    body = {k: v for k, v in obj.items() if k not in _ROOT_KEEP}
    old_body = None if old is None else {k: v for k, v in old.items() if k not in _ROOT_KEEP}
    root_schema = {k: v for k, v in schema.items() if k != "required"}
    props = {k: v for k, v in (schema.get("properties") or {}).items() if k not in _ROOT_KEEP}
    root_schema["properties"] = props
    errors = list(_validate(body, root_schema, "", old_body, has_old=old is not None))
    for required in schema.get("required") or []:
        if required not in obj and required not in _ROOT_KEEP:
            errors.append(FieldError(required, "FieldValueRequired", ""))
    return errors


def _validate(
    value: Any, schema: Schema, path: str, old: Any, has_old: bool
) -> Iterator[FieldError]:
    where = path or "<nil>"
    if value is None:
        if not schema.get("nullable") and schema.get("type"):
            yield FieldError(where, "FieldValueRequired", "")
        return
    expected = schema.get("type")
    if schema.get("x-kubernetes-int-or-string"):
        if not isinstance(value, (int, str)) or isinstance(value, bool):
            detail = f'{where} in body must be of type int-or-string: "{_json_type(value)}"'
            yield FieldError(where, "FieldValueTypeInvalid", detail, _json_type(value))
            return
    elif expected and not _TYPES.get(expected, lambda v: True)(value):
        detail = f'{where} in body must be of type {expected}: "{_json_type(value)}"'
        yield FieldError(where, "FieldValueTypeInvalid", detail, _json_type(value))
        return
    errors = list(_keywords(value, schema, where))
    if isinstance(value, dict):
        props: dict[str, Schema] = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key in schema.get("required") or []:
            if key not in value:
                errors.append(FieldError(_join(path, key), "FieldValueRequired", ""))
        for key, item in value.items():
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            if sub is not None:
                old_item = old.get(key) if isinstance(old, dict) else None
                has_old_item = isinstance(old, dict) and key in old
                errors.extend(_validate(item, sub, _join(path, key), old_item, has_old_item))
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for n, item in enumerate(value):
            errors.extend(_validate(item, schema["items"], f"{path}[{n}]", None, False))
    for combinator in ("allOf", "anyOf", "oneOf", "not"):
        if combinator in schema:
            errors.extend(_combinator(combinator, value, schema[combinator], where))
    if not errors:
        errors.extend(_rules(value, schema, where, old, has_old))
    yield from errors


def _keywords(value: Any, schema: Schema, where: str) -> Iterator[FieldError]:
    def bad(detail: str) -> FieldError:
        return FieldError(where, "FieldValueInvalid", f"{where} in body {detail}", value)

    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema:
            if schema.get("exclusiveMinimum") and value <= schema["minimum"]:
                yield bad(f"should be greater than {schema['minimum']}")
            elif value < schema["minimum"]:
                yield bad(f"should be greater than or equal to {schema['minimum']}")
        if "maximum" in schema:
            if schema.get("exclusiveMaximum") and value >= schema["maximum"]:
                yield bad(f"should be less than {schema['maximum']}")
            elif value > schema["maximum"]:
                yield bad(f"should be less than or equal to {schema['maximum']}")
        if "multipleOf" in schema and value % schema["multipleOf"]:
            yield bad(f"should be a multiple of {schema['multipleOf']}")
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            yield bad(f"should be at least {schema['minLength']} chars long")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            yield bad(f"should be at most {schema['maxLength']} chars long")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            yield bad(f"should match '{schema['pattern']}'")
    if isinstance(value, list):
        if "minItems" in schema and len(value) < schema["minItems"]:
            yield bad(f"should have at least {schema['minItems']} items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            yield FieldError(
                where,
                "FieldValueTooMany",
                f"must have at most {schema['maxItems']} items",
                len(value),
            )
        if schema.get("uniqueItems") and len({repr(v) for v in value}) != len(value):
            yield FieldError(where, "FieldValueDuplicate", "", value)
    if isinstance(value, dict):
        if "minProperties" in schema and len(value) < schema["minProperties"]:
            yield bad(f"should have at least {schema['minProperties']} properties")
        if "maxProperties" in schema and len(value) > schema["maxProperties"]:
            yield bad(f"should have at most {schema['maxProperties']} properties")
    if "enum" in schema and value not in schema["enum"]:
        supported = ", ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in schema["enum"])
        yield FieldError(where, "FieldValueNotSupported", f"supported values: {supported}", value)


def _combinator(name: str, value: Any, spec: Any, where: str) -> Iterator[FieldError]:
    def ok(sub: Schema) -> bool:
        return not list(_validate(value, {**sub, "type": sub.get("type")}, where, None, False))

    if name == "allOf":
        for sub in spec:
            yield from _validate(value, sub, where, None, False)
    elif name == "anyOf" and not any(ok(sub) for sub in spec):
        yield FieldError(where, "FieldValueInvalid", "must validate at least one schema (anyOf)")
    elif name == "oneOf" and sum(ok(sub) for sub in spec) != 1:
        yield FieldError(
            where, "FieldValueInvalid", "must validate one and only one schema (oneOf)"
        )
    elif name == "not" and ok(spec):
        yield FieldError(where, "FieldValueInvalid", "must not validate the schema (not)")


_REASONS = {
    "FieldValueInvalid": "FieldValueInvalid",
    "FieldValueForbidden": "FieldValueForbidden",
    "FieldValueRequired": "FieldValueRequired",
    "FieldValueDuplicate": "FieldValueDuplicate",
}


def _rules(value: Any, schema: Schema, where: str, old: Any, has_old: bool) -> Iterator[FieldError]:
    for rule in schema.get("x-kubernetes-validations") or []:
        program = compiled(rule["rule"])
        if program.uses_old_self and not has_old:
            continue  # transition rules run on updates only
        field = where
        if rule.get("fieldPath"):
            suffix = rule["fieldPath"]
            field = suffix.lstrip(".") if where == "<nil>" else where + suffix
        try:
            result = program.evaluate(value, old)
        except cel.CelEvalError as exc:
            yield FieldError(field, "FieldValueInvalid", f"{rule['rule']}: {exc}", value)
            continue
        if result is True:
            continue
        message = rule.get("message") or f"failed rule: {rule['rule']}"
        if rule.get("messageExpression"):
            with contextlib.suppress(cel.CelEvalError):
                message = str(compiled(rule["messageExpression"]).evaluate(value, old))
        kind = _REASONS.get(rule.get("reason", ""), "FieldValueInvalid")
        yield FieldError(field, kind, message, value)


_CACHE: dict[str, cel.Program] = {}


def compiled(rule: str) -> cel.Program:
    if rule not in _CACHE:
        _CACHE[rule] = cel.compile_rule(rule)
    return _CACHE[rule]


def check_schema(schema: Schema, path: str = "openAPIV3Schema") -> list[FieldError]:
    """Compile-time checks of a CRD schema: every CEL rule must be in the supported subset."""
    errors: list[FieldError] = []
    for n, rule in enumerate(schema.get("x-kubernetes-validations") or []):
        for key in ("rule", "messageExpression"):
            if key in rule:
                try:
                    compiled(rule[key])
                except cel.CelSyntaxError as exc:
                    where = f"{path}.x-kubernetes-validations[{n}].{key}"
                    errors.append(
                        FieldError(
                            where, "FieldValueInvalid", f"compilation failed: {exc}", rule[key]
                        )
                    )
    for key, sub in (schema.get("properties") or {}).items():
        errors.extend(check_schema(sub, f"{path}.properties[{key}]"))
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            errors.extend(check_schema(schema[key], f"{path}.{key}"))
    return errors
