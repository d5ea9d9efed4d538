"""Which JSON schemas the grammar engine enforces exactly, checked before anything compiles.

xgrammar turns a schema into a grammar; for a few keywords it only approximates (it warns and
lets through values the schema forbids). A request with such a schema gets a 400 naming the
keyword and where it is, instead of outputs that may not validate. `tests/test_json_schema_support.py`
checks the rule on the official JSON-Schema-Test-Suite: every schema accepted here rejects each
of the suite's invalid instances.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tokenmill.errors import InvalidRequestError

_TYPES = {"null", "boolean", "object", "array", "number", "string", "integer"}
# keywords whose constraint xgrammar does not enforce (the grammar would accept invalid values)
_UNSUPPORTED = {
    "not": "'not'",
    "if": "'if'/'then'/'else'",
    "then": "'if'/'then'/'else'",
    "else": "'if'/'then'/'else'",
    "dependentSchemas": "'dependentSchemas'",
    "dependentRequired": "'dependentRequired'",
    "dependencies": "'dependencies'",
    "contains": "'contains'",
    "minContains": "'minContains'",
    "maxContains": "'maxContains'",
    "$dynamicRef": "'$dynamicRef'",
    "$recursiveRef": "'$recursiveRef'",
}
# keywords that constrain one type only: xgrammar applies them only where the schema names a type,
# so a schema without one gets the types its keywords imply (a narrower grammar, still valid output)
_TYPED_KEYWORDS = {
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "string": ("minLength", "maxLength", "pattern", "format"),
    "array": ("items", "prefixItems", "minItems", "maxItems", "uniqueItems", "unevaluatedItems"),
    "object": ("properties", "required", "additionalProperties", "patternProperties", "propertyNames",
               "minProperties", "maxProperties", "unevaluatedProperties"),
}
_UNTYPED_OK = ("type", "enum", "const", "$ref", "anyOf", "oneOf", "allOf")
# xgrammar builds a node from one of these and ignores its other constraints
_TAKE_OVER = ("$ref", "anyOf", "oneOf", "allOf", "enum", "const")
_CONSTRAINTS = {k for keys in _TYPED_KEYWORDS.values() for k in keys} | {"type"}
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "propertyNames", "additionalItems")
_MAX_DEPTH = 64


def parse_json_schema(schema: str | dict | bool, param: str) -> dict | bool:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise InvalidRequestError(f"the JSON schema is not valid JSON: {e}", param=param) from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError("the JSON schema must be an object", param=param)
    return schema


def prepare_json_schema(schema: dict | bool, param: str) -> dict | bool:
    """The schema to compile: types made explicit where keywords imply them. Raises
    InvalidRequestError (naming the keyword and its location) for a schema the grammar cannot
    enforce exactly."""
    schema = _with_implied_types(schema)
    _Checker(schema, param).check(schema, "#", 0)
    return schema


def _with_implied_types(node: Any) -> Any:
    if isinstance(node, list):
        return [_with_implied_types(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k in _SUBSCHEMA_MAPS and isinstance(v, dict):  # names -> schemas, not a schema
            out[k] = {name: _with_implied_types(s) for name, s in v.items()}
        elif k in _SUBSCHEMA_LISTS or k in _SUBSCHEMAS:
            out[k] = _with_implied_types(v)
        else:  # values (enum, const, default, examples...) and keywords without subschemas
            out[k] = v
    if not any(k in node for k in _UNTYPED_OK):
        implied = [t for t, keys in _TYPED_KEYWORDS.items() if any(k in node for k in keys)]
        if implied:
            if "number" in implied and node.get("multipleOf") is not None and float(node["multipleOf"]).is_integer():
                implied[implied.index("number")] = "integer"
            out["type"] = implied[0] if len(implied) == 1 else implied
    return out


class _Checker:
    def __init__(self, root: dict | bool, param: str):
        self.root = root
        self.param = param

    def fail(self, where: str, msg: str) -> None:
        raise InvalidRequestError(f"unsupported JSON schema at {where}: {msg}", param=self.param)

    def check(self, node: Any, where: str, depth: int) -> None:
        if depth > _MAX_DEPTH:
            self.fail(where, f"nested deeper than {_MAX_DEPTH} levels")
        if node is False:
            self.fail(where, "the schema `false` accepts no value")
        if node is True:
            return
        if not isinstance(node, dict):
            self.fail(where, f"a schema must be an object or a boolean, got {type(node).__name__}")
        for key, label in _UNSUPPORTED.items():
            if key in node:
                self.fail(where, f"{label} is not supported")
        self._check_types(node, where)
        self._check_ref(node, where)
        self._check_combinators(node, where)
        self._check_take_over(node, where)
        self._check_object(node, where)
        for key in _SUBSCHEMA_MAPS:
            sub = node.get(key)
            if sub is not None:
                if not isinstance(sub, dict):
                    self.fail(f"{where}/{key}", "must be an object")
                for name, s in sub.items():
                    self.check(s, f"{where}/{key}/{name}", depth + 1)
        for key in _SUBSCHEMA_LISTS:
            sub = node.get(key)
            if sub is not None:
                if not isinstance(sub, list) or not sub:
                    self.fail(f"{where}/{key}", "must be a non-empty array")
                for i, s in enumerate(sub):
                    self.check(s, f"{where}/{key}/{i}", depth + 1)
        for key in _SUBSCHEMAS:
            sub = node.get(key)
            if sub is not None and sub is not False:
                self.check(sub, f"{where}/{key}", depth + 1)

    def _check_types(self, node: dict, where: str) -> None:
        t = node.get("type")
        types = t if isinstance(t, list) else [t] if t is not None else []
        for x in types:
            if x not in _TYPES:
                self.fail(f"{where}/type", f"unknown type {x!r}")
        if "multipleOf" in node:
            m = node["multipleOf"]
            if types != ["integer"] or not isinstance(m, int) or isinstance(m, bool) or m <= 0:
                self.fail(where, "'multipleOf' is supported only as a positive integer on type integer")
        if node.get("uniqueItems") is True:
            self.fail(where, "'uniqueItems' is not supported")

    def _check_ref(self, node: dict, where: str) -> None:
        ref = node.get("$ref")
        if ref is None:
            return
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            self.fail(where, f"only local references ('#' or '#/...') are supported, got $ref {ref!r}")
        if where != "#" and "$id" in node:
            self.fail(where, "'$id' in a subschema (a new base URI) is not supported")

    def _check_combinators(self, node: dict, where: str) -> None:
        all_of = node.get("allOf")
        if isinstance(all_of, list) and len(all_of) > 1:
            self.fail(where, "'allOf' with more than one schema is not supported (merge them)")
        one_of = node.get("oneOf")
        if isinstance(one_of, list) and len(one_of) > 1 and not _disjoint([self.resolve(a) for a in one_of]):
            self.fail(where, "'oneOf' is supported only when its alternatives cannot overlap (different "
                             "types, or a required property with different const values); use 'anyOf'")
        for key in ("unevaluatedProperties", "unevaluatedItems"):
            if key in node and (node[key] is not False or any(k in node for k in ("allOf", "anyOf", "oneOf", "$ref"))):
                self.fail(where, f"'{key}' is supported only as false, next to no 'allOf'/'anyOf'/'oneOf'/'$ref'")

    def resolve(self, node: Any) -> Any:
        """A local `$ref` followed to its target (a few hops at most); anything else as it is."""
        for _ in range(8):
            ref = node.get("$ref") if isinstance(node, dict) else None
            if not isinstance(ref, str) or not ref.startswith("#"):
                return node
            target = self.root
            for part in filter(None, ref[1:].split("/")):
                part = part.replace("~1", "/").replace("~0", "~")
                if isinstance(target, dict) and part in target:
                    target = target[part]
                elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                    target = target[int(part)]
                else:
                    self.fail("#", f"$ref {ref!r} points nowhere")
            node = target
        return node

    def _check_take_over(self, node: dict, where: str) -> None:
        takers = [k for k in _TAKE_OVER if k in node]
        if len(takers) > 1:
            self.fail(where, f"'{takers[0]}' and '{takers[1]}' in one schema are not supported (nest one in "
                             "the other)")
        if not takers:
            return
        taker = takers[0]
        extra = sorted(k for k in node if k in _CONSTRAINTS and k != "type")
        if extra:
            self.fail(where, f"'{extra[0]}' next to '{taker}' is not supported (move it into the alternatives)")
        if "type" not in node:
            return
        allowed = _type_set(node["type"])
        if taker in ("enum", "const"):
            values = node["const"] if taker == "const" else node["enum"]
            for v in [values] if taker == "const" else values if isinstance(values, list) else []:
                if not _type_set(_json_type(v)) & allowed:
                    self.fail(where, f"{taker} value {json.dumps(v)[:40]} is not of type {node['type']}")
            return
        alternatives = [node[taker]] if taker == "$ref" else node[taker] if isinstance(node[taker], list) else []
        for alt in alternatives:
            alt = self.resolve(alt)
            t = alt.get("type") if isinstance(alt, dict) else None
            if t is None or not _type_set(t) <= allowed:
                self.fail(where, f"'type' next to '{taker}' is supported only when every alternative has a "
                                 "type within it")

    def _check_object(self, node: dict, where: str) -> None:
        for key in ("enum", "required", "prefixItems"):
            if key in node and not isinstance(node[key], list):
                self.fail(f"{where}/{key}", "must be an array")
        props = node.get("properties") or {}
        missing = [r for r in node.get("required", []) if r not in props]
        if missing:
            self.fail(where, f"required property {missing[0]!r} is not in 'properties'")
        patterns = node.get("patternProperties")
        if patterns:
            if len(patterns) > 1:
                self.fail(where, "'patternProperties' with more than one pattern is not supported")
            (pattern,) = patterns
            try:
                named = [p for p in props if re.search(pattern, p)]
            except re.error:
                named = []
            if named:
                self.fail(where, f"property {named[0]!r} is both in 'properties' and matched by "
                                 f"'patternProperties' {pattern!r}; this is not supported")


def _type_set(t: Any) -> set[str]:
    ts = set(t if isinstance(t, list) else [t])
    return ts | {"integer"} if "number" in ts else ts


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer()):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(v), "unknown")


def _disjoint(alternatives: list) -> bool:
    """Whether no value can match two of the alternatives: each names its types and no type is
    shared, or all are objects that require one property with a distinct const value."""
    type_sets = []
    for alt in alternatives:
        t = alt.get("type") if isinstance(alt, dict) else None
        if t is None:
            break
        ts = set(t if isinstance(t, list) else [t])
        if "number" in ts:
            ts.add("integer")
        type_sets.append(ts)
    else:
        seen: set = set()
        if all(not (ts & seen) and not seen.update(ts) for ts in type_sets):
            return True
    return _discriminated(alternatives)


def _discriminated(alternatives: list) -> bool:
    if not all(isinstance(a, dict) and isinstance(a.get("properties"), dict) for a in alternatives):
        return False
    common = set.intersection(*(set(a.get("required", [])) for a in alternatives))
    for name in common:
        values = []
        for a in alternatives:
            prop = a["properties"].get(name)
            if not isinstance(prop, dict):
                break
            if "const" in prop:
                values.append(json.dumps(prop["const"], sort_keys=True))
            elif isinstance(prop.get("enum"), list) and len(prop["enum"]) == 1:
                values.append(json.dumps(prop["enum"][0], sort_keys=True))
            else:
                break
        else:
            if len(set(values)) == len(values):
                return True
    return False
