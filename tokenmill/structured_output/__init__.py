"""Structured outputs: JSON schema, regex, choice, EBNF grammars and structural tags, enforced
token by token with xgrammar. `params` is light (no xgrammar import); `compiler` and `matcher` need
xgrammar (installed by the Makefile with --no-deps, see there)."""

from tokenmill.structured_output.params import GrammarSpec, StructuredOutputsParams

__all__ = ["GrammarSpec", "StructuredOutputsParams"]
