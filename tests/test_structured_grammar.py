"""The grammar layer on the embedded model's real tokenizer: specs from every API shape, 400s that
name the problem, the compile cache, the matcher (bitmask, EOS only where the grammar can end,
rollback), and the JSON-schema support rule checked against the official JSON-Schema-Test-Suite."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from tokenmill.errors import InvalidRequestError
from tokenmill.structured_output import GrammarSpec, StructuredOutputsParams
from tokenmill.structured_output.compiler import MAX_JSON_WHITESPACE, build_grammar, validate
from tokenmill.structured_output.json_schema import prepare_json_schema
from tokenmill.structured_output.matcher import GrammarBitmasks, GrammarState

SUITE = json.loads((Path(__file__).parent / "data" / "json_schema_test_suite.json").read_text())["cases"]


@pytest.fixture(scope="module")
def tokenizer():
    from tokenmill.model.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="module")
def compiler(grammar_compiler):
    return grammar_compiler


def accepts(compiler, spec: GrammarSpec, text: str) -> bool:
    """Whether the grammar takes `text` as a complete output."""
    state = GrammarState(compiler.get(spec))
    return state.matcher.accept_string(text) and state.matcher.is_completed()


def test_choice_regex_grammar_json(compiler):
    choice = StructuredOutputsParams(choice=["yes", 'no "way"', "ünï\\code"]).spec()
    assert all(accepts(compiler, choice, c) for c in ["yes", 'no "way"', "ünï\\code"])
    assert not accepts(compiler, choice, "ye") and not accepts(compiler, choice, "maybe")
    regex = StructuredOutputsParams(regex=r"\d{3}-[a-z]+").spec()
    assert accepts(compiler, regex, "123-abc") and not accepts(compiler, regex, "12-abc")
    ebnf = StructuredOutputsParams(grammar='root ::= "(" [0-9]+ ("+" [0-9]+)* ")"').spec()
    assert accepts(compiler, ebnf, "(1+23)") and not accepts(compiler, ebnf, "(1+)")
    schema = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["age"]}
    js = StructuredOutputsParams(json=schema).spec()
    assert accepts(compiler, js, '{"age": 42}') and not accepts(compiler, js, '{"age": 130}')
    assert not accepts(compiler, js, '{"age": 4, "x": 1}')  # no properties the schema does not name
    obj = StructuredOutputsParams(json_object=True).spec()
    assert accepts(compiler, obj, '{"a": [1, {"b": null}]}') and not accepts(compiler, obj, "[1]")
    tight = StructuredOutputsParams(json=schema, disable_any_whitespace=True).spec()
    assert accepts(compiler, tight, '{"age": 42}') and not accepts(compiler, tight, '{ "age": 42}')
    # free whitespace is bounded per gap (MAX_JSON_WHITESPACE), as in llama.cpp's JSON grammars
    gap = " " * MAX_JSON_WHITESPACE
    assert accepts(compiler, js, '{' + gap + '"age":\n' + gap[1:] + '42}')
    assert not accepts(compiler, js, '{"age":' + gap + ' 42}')


@pytest.mark.parametrize("params, message", [
    (dict(json="{not json"), "not valid JSON"),
    (dict(json={"type": "strin"}), "unknown type 'strin'"),
    (dict(json={"type": "integer", "not": {"const": 3}}), "'not' is not supported"),
    (dict(json={"$ref": "http://example.com/s.json"}), "only local references"),
    (dict(json={"$ref": "#/$defs/missing"}), "Cannot find field"),
    (dict(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]}),
     "required property 'b' is not in 'properties'"),
    (dict(json={"oneOf": [{"type": "integer"}, {"type": "number"}]}), "'oneOf' is supported only"),
    (dict(json={"type": "number", "multipleOf": 0.5}), "'multipleOf'"),
    (dict(json={"type": "integer", "minimum": 5, "maximum": 1}), "minimum greater than maximum"),
    (dict(json={"type": "string", "enum": ["a", 1]}), "enum value 1 is not of type string"),
    (dict(regex="(ab"), "invalid regex"),
    (dict(grammar="root ::= foo"), 'Rule "foo" is not defined'),
    (dict(choice=[]), "non-empty list"),
])
def test_invalid_specs_name_the_problem(params, message):
    with pytest.raises(InvalidRequestError) as e:
        validate(StructuredOutputsParams(**params).spec(), "response_format")
    assert message in e.value.message and e.value.param in ("response_format", "structured_outputs.choice")
    assert "/project/" not in e.value.message  # xgrammar's log prefix is stripped


def test_exactly_one_constraint():
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(InvalidRequestError, match="unknown structured_outputs field"):
        StructuredOutputsParams.from_dict({"jsonn": {}})


def test_compile_cache_and_failures(compiler):
    spec = StructuredOutputsParams(regex="[a-c]{2}").spec()
    assert compiler.submit(spec) is compiler.submit(GrammarSpec("regex", "[a-c]{2}"))
    bad = GrammarSpec("regex", "(unclosed")
    with pytest.raises(InvalidRequestError):
        compiler.get(bad)
    assert bad not in compiler._cache  # failures are not kept


def test_bitmask_allows_eos_only_where_the_grammar_ends(compiler, tokenizer):
    spec = StructuredOutputsParams(choice=["cat", "catalog"]).spec()
    state = GrammarState(compiler.get(spec))
    masks = GrammarBitmasks(vocab_size=49152)
    for tok in tokenizer.encode("cat"):
        assert state.accept(tok)
    logits = torch.zeros(2, 49152)
    masks.apply(logits, [state, None])
    allowed = set((logits[0] > float("-inf")).nonzero().flatten().tolist())
    assert 2 in allowed  # "cat" may end here: EOS allowed
    assert all(tokenizer.decode([t]) and "catalog".startswith("cat" + tokenizer.decode([t])) for t in allowed - {2})
    assert bool((logits[1] == 0).all())  # a row without a grammar is untouched
    for tok in tokenizer.encode("alog"):
        assert state.accept(tok)
    logits = torch.zeros(1, 49152)
    masks.apply(logits, [state])
    assert (logits[0] > float("-inf")).nonzero().flatten().tolist() == [2]  # complete: only EOS
    assert state.accept(2) and state.is_terminated


def test_rollback_and_replay(compiler, tokenizer):
    spec = StructuredOutputsParams(json={"type": "array", "items": {"type": "boolean"}}).spec()
    grammar = compiler.get(spec)
    tokens = tokenizer.encode("[true, false]")
    state = GrammarState(grammar, tokens[:2])
    for t in tokens[2:]:
        assert state.accept(t)
    state.rollback(len(tokens) - 2)  # e.g. rejected draft tokens
    replayed = GrammarState(grammar, tokens[:2])
    masks = GrammarBitmasks(vocab_size=49152)
    a, b = torch.zeros(1, 49152), torch.zeros(1, 49152)
    masks.apply(a, [state])
    masks.apply(b, [replayed])
    assert torch.equal(a, b)
    assert state.num_accepted == 2
    assert not GrammarState(grammar).accept(tokenizer.encode("{")[0])


def test_json_schema_suite_never_loose(compiler):
    """Every schema of the JSON-Schema-Test-Suite (draft 2020-12) is either refused with a reason,
    or compiles to a grammar that rejects every instance the suite calls invalid."""
    accepted = refused = 0
    for case in SUITE:
        try:
            schema = prepare_json_schema(case["schema"], "response_format")
            grammar = build_grammar(GrammarSpec("json", json.dumps(case["schema"])))
        except InvalidRequestError as e:
            assert e.message, case["description"]
            refused += 1
            continue
        compiled = compiler._xgr.compile_grammar(grammar)
        for test in case["tests"]:
            state = GrammarState(compiled)
            ok = state.matcher.accept_string(json.dumps(test["data"])) and state.matcher.is_completed()
            if ok:  # what the grammar takes, the (type-completed) schema and the original accept
                assert test["valid"], (case["keyword"], case["description"], test["data"])
                jsonschema.Draft202012Validator(schema).validate(test["data"])
        accepted += 1
    assert accepted >= 80 and refused >= 150, (accepted, refused)


def test_runner_state_rollback(compiler, tokenizer):
    """The runner's per-request state advances its matcher with each appended token and rolls it
    back with the tokens (the seam speculative decoding uses for rejected drafts)."""
    from tokenmill.core.messages import CoreSamplingParams
    from tokenmill.core.scheduler_output import NewRequestData
    from tokenmill.worker.request_state import RequestState

    spec = StructuredOutputsParams(regex="(yes|no), (yes|no)").spec()
    new = NewRequestData("r", [1, 2, 3], CoreSamplingParams(grammar=spec), [2], [0], 0)
    state = RequestState.new(new, torch.device("cpu"), compiler.submit)
    tokens = tokenizer.encode("yes, no")
    for t in tokens:
        state.append(t)
    assert state.grammar.num_accepted == len(tokens) and state.output_token_ids == tokens
    state.rollback(len(tokens) - 1)
    assert state.token_ids == [1, 2, 3, tokens[0]] and state.grammar.num_accepted == 1
    masks = GrammarBitmasks(vocab_size=49152)
    a, b = torch.zeros(1, 49152), torch.zeros(1, 49152)
    masks.apply(a, [state.grammar])
    masks.apply(b, [GrammarState(compiler.get(spec), tokens[:1], stop_token_ids=[2])])
    assert torch.equal(a, b)
    with pytest.raises(ValueError):
        state.rollback(5)


def test_bitmask_filled_ahead_matches_filled_on_demand(compiler, tokenizer):
    """The masks started before the forward (batched, on the helper thread) are the ones filled
    when the logits arrive; a batch that changed in between is filled anew, not with stale rows."""
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": "integer"}}}).spec()
    grammar = compiler.get(spec)
    prefixes = ["", '{"n"', '{"n": 1', '{"n": 12}']
    states = [GrammarState(grammar, tokenizer.encode(p), stop_token_ids=[2]) for p in prefixes]
    grammars = [states[0], None, states[1], states[2], states[3]]
    ahead, on_demand = GrammarBitmasks(vocab_size=49152), GrammarBitmasks(vocab_size=49152)
    a, b = torch.zeros(len(grammars), 49152), torch.zeros(len(grammars), 49152)
    ahead.start(grammars)
    ahead.apply(a, grammars)
    on_demand.apply(b, grammars)
    assert torch.equal(a, b)
    assert bool((a[1] == 0).all())  # the unconstrained row is untouched
    assert (a[4] > float("-inf")).nonzero().flatten().tolist() == [2]  # complete object: only EOS
    for row in (0, 2, 3):
        assert 0 < int((a[row] > float("-inf")).sum()) < 49152
    ahead.start(grammars)  # the batch changes before the logits come: fill what is asked
    c, d = torch.zeros(2, 49152), torch.zeros(2, 49152)
    ahead.apply(c, [states[3], states[0]])
    on_demand.apply(d, [states[3], states[0]])
    assert torch.equal(c, d) and (c[0] > float("-inf")).nonzero().flatten().tolist() == [2]
    ahead.close()
