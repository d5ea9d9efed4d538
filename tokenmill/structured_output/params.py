"""What a request asks its output to match (vLLM's `StructuredOutputsParams`), and the plain
`GrammarSpec` it becomes: the one thing the core and the worker see, and the compile cache key."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

import msgspec

from tokenmill.errors import InvalidRequestError

MAX_JSON_WHITESPACE = 20  # free whitespace characters between two JSON tokens (compiler.py)


class GrammarSpec(msgspec.Struct, frozen=True):
    """kind: "json" (text = a JSON schema), "regex", "grammar" (EBNF/GBNF) or "structural_tag"
    (text = xgrammar's structural tag JSON, used for tool calls). Hashable: equal specs share one
    compiled grammar."""

    kind: str
    text: str
    any_whitespace: bool = True


@dataclass
class StructuredOutputsParams:
    """Exactly one of json / regex / choice / grammar / json_object / structural_tag."""

    json: str | dict | None = None  # a JSON schema (dict or its text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF-style `root ::= ...`)
    json_object: bool | None = None  # any JSON object
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool = False  # JSON without free whitespace between tokens

    def __post_init__(self):
        given = [f.name for f in fields(self) if f.name != "disable_any_whitespace"
                 and getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError("structured_outputs needs exactly one of json, regex, choice, grammar, "
                                      f"json_object, structural_tag (got {', '.join(given) or 'none'})",
                                      param="structured_outputs")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError("structured_outputs.choice must be a non-empty list of non-empty strings",
                                      param="structured_outputs.choice")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise InvalidRequestError(f"structured_outputs.{name} must be a non-empty string",
                                          param=f"structured_outputs.{name}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StructuredOutputsParams:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise InvalidRequestError(f"unknown structured_outputs field(s): {', '.join(unknown)}",
                                      param="structured_outputs")
        return cls(**d)

    def spec(self) -> GrammarSpec:
        """The spec to compile. Only shapes it: `tokenmill.structured_output.compiler.validate`
        checks that it compiles."""
        ws = not self.disable_any_whitespace
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else json.dumps(self.json, ensure_ascii=False)
            return GrammarSpec("json", text, ws)
        if self.json_object:
            return GrammarSpec("json", '{"type": "object"}', ws)
        if self.regex is not None:
            return GrammarSpec("regex", self.regex)
        if self.choice is not None:
            return GrammarSpec("grammar", choice_grammar(self.choice))
        if self.grammar is not None:
            return GrammarSpec("grammar", self.grammar)
        tag = self.structural_tag
        return GrammarSpec("structural_tag", tag if isinstance(tag, str) else json.dumps(tag, ensure_ascii=False))


def choice_grammar(choices: list[str]) -> str:
    """EBNF matching exactly one of the strings (JSON string escapes are EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))
