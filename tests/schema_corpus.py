"""The JSON schemas the structured-output proof samples from: the draft 2020-12 schemas of the
official JSON-Schema-Test-Suite (tests/data, from the jsonschema sdist on PyPI) that the grammar
enforces, plus generated ones covering objects, arrays, enums, nested $ref (also recursive),
anyOf / discriminated oneOf, numbers with bounds, string patterns and formats."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenmill.errors import InvalidRequestError
from tokenmill.structured_output import GrammarSpec
from tokenmill.structured_output.compiler import build_grammar
from tokenmill.structured_output.json_schema import prepare_json_schema

_SUITE = Path(__file__).parent / "data" / "json_schema_test_suite.json"
_WORDS = ["id", "name", "title", "count", "price", "tags", "owner", "city", "score", "active", "kind", "items",
          "date", "email", "level", "notes", "size", "color", "rank", "code"]


def suite_schemas() -> list[tuple[str, dict]]:
    """Suite schemas the grammar enforces and that some value satisfies."""
    out = []
    for case in json.loads(_SUITE.read_text())["cases"]:
        if not any(t["valid"] for t in case["tests"]):
            continue
        try:
            build_grammar(GrammarSpec("json", json.dumps(case["schema"])))
        except InvalidRequestError:
            continue
        out.append((f"suite/{case['keyword']}/{case['description']}", case["schema"]))
    return out


class _Gen:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def leaf(self) -> dict:
        r = self.rng
        pick = r.randrange(9)
        if pick == 0:
            lo = r.randint(-50, 50)
            return {"type": "integer", "minimum": lo, "maximum": lo + r.randint(0, 100)}
        if pick == 1:
            return {"type": "number", "exclusiveMinimum": r.choice([-1.5, 0, 2.25]),
                    "maximum": r.choice([3, 10.5, 1000])}
        if pick == 2:
            return {"type": "string", "pattern": r.choice([r"^[A-Z]{2}-\d{3}$", r"^[a-z]+(_[a-z]+)*$",
                                                           r"^\+?[0-9]{7,12}$", r"^#[0-9a-f]{6}$"])}
        if pick == 3:
            return {"type": "string", "enum": r.sample(["red", "green", "blue", "small", "large", "yes", "no"],
                                                       r.randint(2, 4))}
        if pick == 4:
            return {"type": "string", "minLength": r.randint(0, 3), "maxLength": r.randint(4, 12)}
        if pick == 5:
            return {"type": "string", "format": r.choice(["date", "email", "uuid", "date-time", "ipv4"])}
        if pick == 6:
            return {"type": "boolean"}
        if pick == 7:
            return {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}]}
        return {"const": r.choice(["v1", 7, True])}

    def node(self, depth: int) -> dict:
        r = self.rng
        if depth <= 0 or r.random() < 0.35:
            return self.leaf()
        pick = r.randrange(4)
        if pick == 0:
            return self.obj(depth - 1)
        if pick == 1:
            lo = r.randint(0, 2)
            return {"type": "array", "items": self.node(depth - 1), "minItems": lo, "maxItems": lo + r.randint(0, 3)}
        if pick == 2:
            return {"anyOf": [self.obj(depth - 1), self.leaf()]}
        return {"type": "array", "prefixItems": [self.leaf(), self.leaf()], "items": False}

    def obj(self, depth: int) -> dict:
        r = self.rng
        names = r.sample(_WORDS, r.randint(1, 4))
        props = {n: self.node(depth) for n in names}
        required = [n for n in names if r.random() < 0.7]
        out = {"type": "object", "properties": props, "required": required}
        if r.random() < 0.3:
            out["additionalProperties"] = False
        return out


def _refs(seed: int) -> dict:
    """Nested $ref through $defs; every other one recursive (a tree or a linked list)."""
    g = _Gen(seed)
    if seed % 2:
        return {"$defs": {"node": {"type": "object", "properties": {
            "value": g.leaf(), "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
            "required": ["value", "children"]}}, "$ref": "#/$defs/node"}
    return {"type": "object", "$defs": {"point": g.obj(0), "shape": {"type": "object", "properties": {
        "origin": {"$ref": "#/$defs/point"}, "kind": {"enum": ["circle", "square"]}}, "required": ["origin", "kind"]}},
        "properties": {"shapes": {"type": "array", "items": {"$ref": "#/$defs/shape"}, "maxItems": 3},
                       "main": {"$ref": "#/$defs/shape"}}, "required": ["main"]}


def _discriminated(seed: int) -> dict:
    g = _Gen(seed)
    return {"oneOf": [{"type": "object", "properties": {"kind": {"const": k}, "data": g.leaf()},
                       "required": ["kind", "data"]} for k in ("cat", "dog", "bird")[:2 + seed % 2]]}


def generated_schemas(n: int = 180, seed: int = 0) -> list[tuple[str, dict]]:
    out = []
    for i in range(n):
        g = _Gen(seed * 100_000 + i)
        kind = i % 6
        if kind == 0:
            schema = _refs(i)
        elif kind == 1:
            schema = _discriminated(i)
        elif kind == 2:
            schema = {"type": "array", "items": g.obj(1), "minItems": 1, "maxItems": 3}
        elif kind == 3:
            schema = g.leaf()
        else:
            schema = g.obj(2)
        prepare_json_schema(schema, "json")  # the generator only makes enforceable schemas
        out.append((f"generated/{i}", schema))
    return out


def corpus() -> list[tuple[str, dict]]:
    return suite_schemas() + generated_schemas()
