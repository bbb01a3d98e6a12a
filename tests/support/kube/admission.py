"""What a real API server does with a custom resource before storing it: default, validate, check CEL rules.

kmock stores whatever it is sent, so the tests do this part themselves: structural defaulting, the OpenAPI v3
schema (types, enums, bounds, patterns, required and unknown fields) and the `x-kubernetes-validations` CEL
rules, evaluated with cel-python. Error messages follow the API server's wording, so the tests show what a user
would read (`kubectl apply` prints them as `The InferenceService "x" is invalid: <field>: <message>`).

On `POST customresourcedefinitions` it also does what the apiextensions-apiserver does with the CRD's own defaults:
each raw default is checked against its level's schema and CEL rules (`crd_default_errors`), so an unguarded rule
on a `default: {}` level refuses the CRD as a real cluster would ("no such key: ... evaluating rule: ...").

It also checks the CRD's schemas as the apiextensions-apiserver does (`crd_schema_errors`): the structural-schema
rules (a type at every level, items on arrays, properties or additionalProperties), defaults without unknown fields
and CEL rules that compile.

Not covered (the CRD does not use them): oneOf/anyOf, formats beyond date-time, transition rules (oldSelf); of the
CRD checks, CEL type checking against the schema and the cost estimate (cel-python has neither), and the
metadata and allOf/anyOf/oneOf/not restrictions of structural schemas.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import celpy

from tests.support.kube.status import api_status

_cel_env = celpy.Environment()
_cel_programs: dict[str, Any] = {}


class Invalid(Exception):
    """422: the object breaks the schema or a CEL rule. `causes` holds (field, message) pairs."""

    def __init__(self, causes: list[tuple[str, str]]):
        self.causes = causes
        super().__init__(", ".join(f"{field}: {message}" for field, message in causes))


class UnknownFields(Exception):
    """400 under strict field validation (kubectl's default): fields the schema does not declare."""

    def __init__(self, paths: list[str]):
        self.paths = paths
        super().__init__(", ".join(f'unknown field "{path}"' for path in paths))


def admit(obj: dict[str, Any], schema: dict[str, Any], *, strict: bool) -> dict[str, Any]:
    """The object as the server would store it (defaulted, unknown fields pruned), or raise Invalid/UnknownFields."""
    obj = copy.deepcopy(obj)
    unknown: list[str] = []
    _prune(obj, schema, "", unknown)
    if unknown and strict:
        raise UnknownFields(unknown)
    _default(obj, schema)
    causes: list[tuple[str, str]] = []
    _validate(obj, schema, "", causes)
    if not causes:  # like the server: CEL only runs on an object that passed the schema
        _check_rules(obj, schema, "", causes)
    if causes:
        raise Invalid(causes)
    return obj


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _preserves(schema: dict[str, Any]) -> bool:
    return bool(schema.get("x-kubernetes-preserve-unknown-fields"))


def _prune(value: Any, schema: dict[str, Any], path: str, unknown: list[str]) -> None:
    if isinstance(value, dict) and schema.get("type") == "object" and path != "metadata":
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key in list(value):
            if props is not None and key in props:
                _prune(value[key], props[key], _join(path, key), unknown)
            elif isinstance(extra, dict):
                _prune(value[key], extra, _join(path, key), unknown)
            elif not _preserves(schema) and (props is not None or extra is None):
                unknown.append(_join(path, key))
                del value[key]
    elif isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            _prune(item, schema["items"], f"{path}[{index}]", unknown)


def _default(value: Any, schema: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                _default(value[key], sub)
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            _default(item, schema["items"])


def _shown(value: Any) -> str:
    return '"object"' if isinstance(value, dict) else json.dumps(value)


_TYPES = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "integer": int,
    "number": (int, float),
}


def _validate(value: Any, schema: dict[str, Any], path: str, causes: list[tuple[str, str]]) -> None:
    where = path or "<root>"
    kind = schema.get("type")
    if schema.get("x-kubernetes-int-or-string"):
        if not isinstance(value, (int, str)) or isinstance(value, bool):
            causes.append((where, f"Invalid value: {_shown(value)}: {where} in body must be of type int-or-string"))
            return
        kind = None  # either type; a string still meets the string checks below (pattern: a quantity's)
    if kind is not None:
        ok = isinstance(value, _TYPES[kind]) and not (isinstance(value, bool) and kind in ("integer", "number"))
        if not ok:
            shown = type(value).__name__.replace("dict", "object").replace("str", "string")
            causes.append((where, f'Invalid value: "{shown}": {where} in body must be of type {kind}: "{shown}"'))
            return
    if "enum" in schema and value not in schema["enum"]:
        supported = ", ".join(_shown(v) for v in schema["enum"])
        causes.append((where, f"Unsupported value: {_shown(value)}: supported values: {supported}"))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        low, high = schema.get("minimum"), schema.get("maximum")
        if low is not None and schema.get("exclusiveMinimum") and value <= low:
            causes.append((where, f"Invalid value: {_shown(value)}: {where} in body should be greater than {low}"))
        elif low is not None and value < low:
            msg = f"{where} in body should be greater than or equal to {low}"
            causes.append((where, f"Invalid value: {_shown(value)}: {msg}"))
        if high is not None and value > high:
            msg = f"{where} in body should be less than or equal to {high}"
            causes.append((where, f"Invalid value: {_shown(value)}: {msg}"))
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            msg = f"{where} in body should be at least {schema['minLength']} chars long"
            causes.append((where, f"Invalid value: {_shown(value)}: {msg}"))
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            causes.append((where, f"Too long: may not be more than {schema['maxLength']} bytes"))
        if "pattern" in schema and not re.search(schema["pattern"], value):
            msg = f"{where} in body should match '{schema['pattern']}'"
            causes.append((where, f"Invalid value: {_shown(value)}: {msg}"))
    if isinstance(value, list):
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            causes.append((where, f"Too many: {len(value)}: must have at most {schema['maxItems']} items"))
        for index, item in enumerate(value):
            _validate(item, schema.get("items") or {}, f"{path}[{index}]", causes)
    if isinstance(value, dict) and path != "metadata":
        for key in schema.get("required") or []:
            if key not in value:
                causes.append((_join(path, key), "Required value"))
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if key in props:
                _validate(item, props[key], _join(path, key), causes)
            elif isinstance(extra, dict):
                _validate(item, extra, _join(path, key), causes)


def _check_rules(value: Any, schema: dict[str, Any], path: str, causes: list[tuple[str, str]]) -> None:
    for rule in schema.get("x-kubernetes-validations") or []:
        if not evaluate(rule["rule"], value):
            causes.append((path or "<root>", f"Invalid value: {_shown(value)}: {rule.get('message', rule['rule'])}"))
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for key, item in value.items():
            if key in props:
                _check_rules(item, props[key], _join(path, key), causes)
    elif isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            _check_rules(item, schema["items"], f"{path}[{index}]", causes)


def evaluate(rule: str, value: Any) -> bool:
    """One CEL rule with `self` bound to `value` (compiled once per rule)."""
    program = _cel_programs.get(rule)
    if program is None:
        program = _cel_programs[rule] = _cel_env.program(_cel_env.compile(rule))
    result = program.evaluate({"self": celpy.json_to_cel(value)})
    if isinstance(result, celpy.CELEvalError):
        raise result
    return bool(result)


def crd_default_errors(crd: dict[str, Any]) -> list[tuple[str, str]]:
    """What the apiextensions-apiserver checks on every `default` of a CRD's schemas when the CRD is created: the
    raw default (nested defaults not applied) against its own level's schema and `x-kubernetes-validations` rules.
    A rule that cannot even evaluate on it (a field the default lacks) is an error too: "no such key"."""
    causes: list[tuple[str, str]] = []

    def walk(node: dict[str, Any], path: str) -> None:
        if "default" in node:
            where = f"{path}.default"
            default = node["default"]
            found: list[tuple[str, str]] = []
            _validate(default, node, "", found)
            causes.extend((where, message) for _, message in found)
            if not found:
                for rule in node.get("x-kubernetes-validations") or []:
                    try:
                        ok = evaluate(rule["rule"], default)
                    except celpy.CELEvalError as exc:
                        why = _cel_error(exc, rule["rule"], default)
                        shown = rule.get("message", rule["rule"])
                        causes.append((where, f"Invalid value: {_shown(default)}: {why} evaluating rule: {shown}"))
                        continue
                    if not ok:
                        causes.append((where, f"Invalid value: {_shown(default)}: {rule.get('message', rule['rule'])}"))
        for key, child in (node.get("properties") or {}).items():
            walk(child, f"{path}.properties[{key}]")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}.items")

    for index, version in enumerate(crd.get("spec", {}).get("versions") or []):
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        if schema:
            walk(schema, f"spec.versions[{index}].schema.openAPIV3Schema")
    return causes


def _cel_error(exc: Exception, rule: str, value: Any) -> str:
    """cel-go's words for the usual failure on a default: the first field the rule reads that the value lacks."""
    if isinstance(value, dict):
        for name in re.findall(r"(?<!has\()self\.(\w+)", rule):
            if name not in value:
                return f"no such key: {name}"
    return str(exc)


def crd_schema_errors(crd: dict[str, Any]) -> list[tuple[str, str]]:
    """The apiextensions-apiserver's structural-schema rules, pruned defaults and CEL compilation, on every version's
    schema, in its words: a `type` at every level (an object at the root), `items` on every array, `properties` or
    `additionalProperties` but not both, defaults without unknown fields, rules that compile."""
    causes: list[tuple[str, str]] = []

    def walk(node: dict[str, Any], path: str, level: str) -> None:
        typed = node.get("type") or node.get("x-kubernetes-int-or-string") or _preserves(node)
        if not typed:
            causes.append((f"{path}.type", f"Required value: must not be empty {level}"))
        if level == "at the root" and node.get("type") not in (None, "object"):
            causes.append((f"{path}.type", f'Invalid value: "{node["type"]}": must be object at the root'))
        if node.get("type") == "array" and not isinstance(node.get("items"), dict):
            causes.append((f"{path}.items", "Required value: must be specified"))
        if node.get("properties") and node.get("additionalProperties") not in (None, True):
            causes.append(
                (f"{path}.additionalProperties", "Forbidden: additionalProperties and properties are mutual exclusive")
            )
        if "default" in node:
            unknown: list[str] = []
            _prune(copy.deepcopy(node["default"]), node, "", unknown)
            if unknown:
                causes.append(
                    (f"{path}.default", f"Invalid value: {_shown(node['default'])}: must not have unknown fields")
                )
        for index, rule in enumerate(node.get("x-kubernetes-validations") or []):
            try:
                _cel_env.compile(rule["rule"])
            except celpy.CELParseError as exc:  # cel-go's form: ERROR: <input>:LINE:COLUMN: Syntax error
                where = f"{path}.x-kubernetes-validations[{index}].rule"
                at = f"<input>:{getattr(exc, 'line', 1)}:{(getattr(exc, 'column', 0) or 0) + 1}"
                causes.append(
                    (where, f'Invalid value: "{rule["rule"]}": compilation failed: ERROR: {at}: Syntax error')
                )
        for key, child in (node.get("properties") or {}).items():
            walk(child, f"{path}.properties[{key}]", "for specified object fields")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}.items", "for specified array items")
        if isinstance(node.get("additionalProperties"), dict):
            walk(node["additionalProperties"], f"{path}.additionalProperties", "for specified object fields")

    for index, version in enumerate(crd.get("spec", {}).get("versions") or []):
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        if schema:
            walk(schema, f"spec.versions[{index}].schema.openAPIV3Schema", "at the root")
    return causes


def admit_crd(crd: dict[str, Any]) -> None:
    """422, as the API server refuses a CRD whose schema is not structural, whose rules do not compile, or whose
    defaults break their own schema or rules."""
    causes = crd_schema_errors(crd) or crd_default_errors(crd)
    if causes:
        name = crd.get("metadata", {}).get("name", "")
        message = f'CustomResourceDefinition.apiextensions.k8s.io "{name}" is invalid: ' + ", ".join(
            f"{field}: {text}" for field, text in causes)  # fmt: skip
        listed = [{"reason": "FieldValueInvalid", "field": f, "message": m} for f, m in causes]
        details = {"name": name, "group": "apiextensions.k8s.io", "kind": "CustomResourceDefinition", "causes": listed}
        raise api_status(422, "Invalid", message, details=details)


def admit_custom_resource(obj: dict, resource, kind: str, schema: dict, *, strict: bool) -> dict:
    """`admit`, with its failures as the API server answers them: 400 for unknown fields under strict decoding,
    422 Invalid with one cause per field otherwise."""
    name = obj.get("metadata", {}).get("name", "")
    try:
        return admit(obj, schema, strict=strict)
    except UnknownFields as exc:
        message = f'{kind} in version "{resource.version}" cannot be handled as a {kind}: strict decoding error: {exc}'
        raise api_status(400, "BadRequest", message) from exc
    except Invalid as exc:
        causes = [{"reason": "FieldValueInvalid", "field": f, "message": m} for f, m in exc.causes]
        details = {"name": name, "group": resource.group, "kind": kind, "causes": causes}
        message = f'{kind}.{resource.group} "{name}" is invalid: {exc}'
        raise api_status(422, "Invalid", message, details) from exc
