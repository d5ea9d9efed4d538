"""Structured outputs through the real engine on the embedded model: sampled at temperature 1,
every finished output matches its JSON schema / regex / choice / grammar; n > 1; greedy results
survive preemption and prefix caching; a grammar that is still compiling holds back only its own
request."""

from __future__ import annotations

import json
import os
import re

import jsonschema
import pytest

from tests.schema_corpus import corpus
from tokenmill import SamplingParams, StructuredOutputsParams

CORPUS = corpus()


def _check_corpus(llm, schemas, max_tokens: int, seed: int) -> None:
    params = [SamplingParams(temperature=1.0, seed=seed + i, max_tokens=max_tokens,
                             structured_outputs=StructuredOutputsParams(json=s)) for i, (_, s) in enumerate(schemas)]
    prompts = [f"Write a JSON value for the schema {name.split('/')[-1]!r}:\n" for name, _ in schemas]
    outs = llm.generate(prompts, params, use_tqdm=False)
    finished = 0
    for (name, schema), out in zip(schemas, outs):
        o = out.outputs[0]
        assert o.finish_reason in ("stop", "length"), (name, o)
        if o.finish_reason == "stop":
            finished += 1
            try:
                value = json.loads(o.text)
            except ValueError:
                pytest.fail(f"{name}: not JSON: {o.text!r}")
            errors = list(jsonschema.Draft202012Validator(schema).iter_errors(value))
            assert not errors, f"{name}: {o.text!r} does not match {json.dumps(schema)}: {errors[0].message}"
    assert finished >= 0.6 * len(schemas), f"only {finished}/{len(schemas)} outputs finished"


@pytest.mark.slow
def test_json_schema_corpus_sample(smol_fp32):
    """A fixed quarter of the corpus (suite and generated schemas) in the default run."""
    _check_corpus(smol_fp32, CORPUS[::4], max_tokens=96, seed=0)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TOKENMILL_SCHEMA_CORPUS") != "full",
                    reason="the whole corpus (~90 s on 2 cores) runs with TOKENMILL_SCHEMA_CORPUS=full")
def test_json_schema_corpus_full(smol_fp32):
    assert len(CORPUS) >= 200
    _check_corpus(smol_fp32, CORPUS, max_tokens=128, seed=1000)


# bounded patterns: each must end within max_tokens (one character a token at worst), so "stop"
# is owed by the grammar, not by luck
@pytest.mark.parametrize("pattern", [r"\d{3}-\d{4}", r"[A-Z][a-z]{2,8} (is|was) [a-z]{1,12}\.",
                                     r"(0|[1-9]\d{0,5})\.\d{2} (USD|EUR)", r"[a-z_][a-z0-9_]{0,10}\(\)"])
def test_regex(smol_fp32, pattern):
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(regex=pattern))
    out = smol_fp32.generate(["Answer: "], params, use_tqdm=False)[0]
    assert len(out.outputs) == 4
    for o in out.outputs:
        assert o.finish_reason == "stop" and re.fullmatch(pattern, o.text), (pattern, o.text)


def test_choice_and_grammar(smol_fp32):
    choices = ["positive", "negative", "neutral", "mixed feelings"]
    params = SamplingParams(n=6, temperature=1.0, seed=3, max_tokens=10,
                            structured_outputs=StructuredOutputsParams(choice=choices))
    out = smol_fp32.generate(["The sentiment of 'I love it' is"], params, use_tqdm=False)[0]
    assert all(o.text in choices and o.finish_reason == "stop" for o in out.outputs)
    greedy = smol_fp32.generate(["The sentiment of 'I love it' is"],
                                SamplingParams(temperature=0, max_tokens=10,
                                               structured_outputs={"choice": choices}), use_tqdm=False)[0]
    assert greedy.outputs[0].text in choices
    ebnf = 'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= num | "(" expr ")"\nnum ::= [1-9] [0-9]{0,2}'
    out = smol_fp32.generate(["2+2="], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=30,
                                                      structured_outputs={"grammar": ebnf}), use_tqdm=False)[0]
    for o in out.outputs:
        if o.finish_reason == "stop":
            assert re.fullmatch(r"(\(|\)|\+|[1-9][0-9]{0,2})+", o.text) and o.text.count("(") == o.text.count(")")


def test_mixed_batch_leaves_unconstrained_requests_alone(smol_fp32):
    """Constrained and unconstrained requests in one batch: the unconstrained greedy output is
    the same as alone."""
    alone = smol_fp32.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16),
                               use_tqdm=False)[0].outputs[0].text
    mixed = smol_fp32.generate(["The capital of France is", "Name a color:"],
                               [SamplingParams(temperature=0, max_tokens=16),
                                SamplingParams(temperature=0, max_tokens=16,
                                               structured_outputs={"choice": ["red", "green"]})], use_tqdm=False)
    assert mixed[0].outputs[0].text == alone and mixed[1].outputs[0].text in ("red", "green")


def test_invalid_spec_is_rejected_before_anything_runs(smol_fp32):
    from tokenmill.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="'not' is not supported"):
        smol_fp32.generate(["x"], SamplingParams(structured_outputs={"json": {"type": "integer", "not": {}}}))
    with pytest.raises(InvalidRequestError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs={"regex": "a+"})
    assert not smol_fp32.engine.has_unfinished_requests()


@pytest.mark.slow
def test_greedy_survives_preemption_and_prefix_caching(smol_fp32):
    """A pool too small for the batch preempts constrained requests (the runner keeps their
    tokens and matchers); prompts share a prefix (prefix-cache hits). Greedy outputs equal those of
    a roomy engine."""
    import gc
    import threading

    from tokenmill import LLM

    schema = {"type": "object", "properties": {"log": {"type": "array", "items": {"type": "object", "properties": {
        "step": {"type": "integer", "minimum": 0}, "ok": {"type": "boolean"}}, "required": ["step", "ok"]}}},
        "required": ["log"]}
    prompts = [f"A long shared system preamble about logging, repeated. Record {i} of the batch as JSON:\n"
               for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=64, structured_outputs={"json": schema})
    roomy = smol_fp32.generate(prompts, params, use_tqdm=False)
    before = set(threading.enumerate())
    tiny = LLM(dtype="float32", quantization="none", kv_cache_memory=17 * 16 * 46080, max_model_len=256, progress=False)
    try:
        outs = tiny.generate(prompts, params, use_tqdm=False)
        core = tiny.engine.core
        assert core.scheduler.num_preemptions > 0 and core.kv.prefix_hits > 0
        for a, b in zip(outs, roomy):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert core.kv.pool.num_free_blocks == core.kv.num_blocks and not core.worker.runner.requests
        # shutting the engine down stops the threads it started: grammar compilation (and mask
        # filling, which greedy rows, checked after sampling, may not need)
        started = [t for t in set(threading.enumerate()) - before if t.name.startswith("tokenmill-grammar")]
        names = {t.name.split("_")[0] for t in started}
        assert "tokenmill-grammar" in names and names <= {"tokenmill-grammar", "tokenmill-grammar-mask"}
        tiny.engine.shutdown()
        for t in started:
            t.join(10)
        assert not [t.name for t in started if t.is_alive()]
    finally:
        del tiny
        gc.collect()


def test_compiling_grammar_holds_back_only_its_request(smol_fp32, monkeypatch):
    """While a grammar compiles, its request waits (WAITING_FOR_GRAMMAR) and others run to the end."""
    import threading

    from tokenmill.core.request import RequestStatus

    engine = smol_fp32.engine
    worker = engine.core.worker
    worker.prepare_grammar(StructuredOutputsParams(choice=["x"]).spec()).result()  # the compiler exists
    compiler = worker._grammar_compiler
    gate, original = threading.Event(), compiler._compile
    monkeypatch.setattr(compiler, "_compile", lambda spec: gate.wait(60) and original(spec))
    pattern = "(ab|cd){2,4}!"  # not compiled before: a cache miss
    engine.add_request("grammar", "Letters:", SamplingParams(temperature=0, max_tokens=12,
                                                             structured_outputs={"regex": pattern}))
    engine.add_request("plain", "Hello", SamplingParams(temperature=0, max_tokens=8))
    finished = {}
    while "plain" not in finished:
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    waiting = engine.core.scheduler.compiling
    assert "grammar" not in finished and [r.request_id for r in waiting] == ["grammar"]
    assert waiting[0].status == RequestStatus.WAITING_FOR_GRAMMAR and engine.core.stats().num_waiting == 1
    gate.set()
    while "grammar" not in finished:
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert re.fullmatch(pattern, finished["grammar"].outputs[0].text)
    assert not engine.has_unfinished_requests()


def test_a_grammar_that_fails_to_compile_fails_only_its_request(smol_fp32, monkeypatch):
    """The front end validates a spec, so a compile failure is unexpected: it fails its request as
    an error (reported like any request that failed alone), and the others run on."""
    engine = smol_fp32.engine
    worker = engine.core.worker
    worker.prepare_grammar(StructuredOutputsParams(choice=["x"]).spec()).result()  # the compiler exists

    def broken(spec):
        raise RuntimeError("the compiler broke")

    monkeypatch.setattr(worker._grammar_compiler, "_compile", broken)
    engine.add_request("grammar", "Letters:", SamplingParams(temperature=0, max_tokens=12,
                                                             structured_outputs={"regex": "(xy|zw){2,5}\\?"}))
    engine.add_request("plain", "Hello", SamplingParams(temperature=0, max_tokens=8))
    finished, failed = {}, {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        failed.update(engine.take_failed())
    assert list(failed) == ["grammar"]
    assert "grammar compile failed: RuntimeError: the compiler broke" in failed["grammar"]
    assert list(finished) == ["plain"] and len(finished["plain"].outputs[0].token_ids) == 8
    kv = engine.core.kv
    assert kv.pool.num_free_blocks == kv.num_blocks
