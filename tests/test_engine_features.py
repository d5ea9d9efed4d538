"""Engine features on the real model: prefix caching by counters, n > 1 sharing the prompt's
blocks, request rejection, the step API, the async engine (streaming, abort on disconnect), stats."""

from __future__ import annotations

import asyncio

import pytest

from tokenmill import SamplingParams
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.engine.stats import StatLogger
from tokenmill.errors import InvalidRequestError

LONG = " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(120))


def _prefix_ids(tok, n):
    ids = tok.encode(LONG)
    assert len(ids) >= n
    return ids[:n]


def test_shared_1000_token_prefix_prefills_only_the_new_tokens(smol_bf16):
    engine = smol_bf16.engine
    kv = engine.core.kv
    prefix = _prefix_ids(smol_bf16.get_tokenizer(), 1000)
    first = prefix + [504, 3458, 282]
    second = prefix + [1522, 314, 253, 1345, 29]
    params = SamplingParams(temperature=0, max_tokens=4)
    smol_bf16.generate([first], params, use_tqdm=False)  # finishes: its blocks are freed but stay cached
    hits_before, queries_before = kv.prefix_hits, kv.prefix_queries
    out = smol_bf16.generate([second], params, use_tqdm=False)[0]
    cached = (1000 // 16) * 16  # every full block inside the shared prefix
    assert kv.prefix_hits - hits_before == cached == out.num_cached_tokens
    assert kv.prefix_queries - queries_before == len(second)


def test_prefill_work_is_only_the_uncached_tail(smol_bf16):
    """Count tokens actually put through the model (the scheduler's batched tokens)."""
    engine = smol_bf16.engine
    prefix = _prefix_ids(smol_bf16.get_tokenizer(), 1000)
    smol_bf16.generate([prefix + [11, 12]], SamplingParams(max_tokens=1), use_tqdm=False)
    core, batched = engine.core, []
    real_schedule = core.scheduler.schedule

    def counting_schedule():
        out = real_schedule()
        batched.append(out.total_num_scheduled_tokens)
        return out

    core.scheduler.schedule = counting_schedule
    try:
        smol_bf16.generate([prefix + [21, 22, 23]], SamplingParams(max_tokens=1), use_tqdm=False)
    finally:
        core.scheduler.schedule = real_schedule
    assert sum(batched) == 1003 - (1000 // 16) * 16


def test_n_samples_share_the_prompt_blocks(smol_bf16):
    engine = smol_bf16.engine
    kv = engine.core.kv
    prompt = _prefix_ids(smol_bf16.get_tokenizer(), 512)
    used_before = kv.num_used_blocks()
    engine.add_request("fan", prompt, SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=0))
    engine.step()
    engine.step()
    held = kv.num_used_blocks() - used_before
    assert held < 2 * (512 // 16)  # four samples, not four copies of the prompt
    while engine.has_unfinished_requests():
        engine.step()
    assert kv.num_used_blocks() == used_before


def test_request_that_cannot_fit_is_rejected_at_submission(smol_bf16):
    engine = smol_bf16.engine
    limit = engine.max_model_len
    with pytest.raises(InvalidRequestError, match=f"{limit}"):
        engine.add_request("big", [5] * 100, SamplingParams(max_tokens=limit))
    assert not engine.has_unfinished_requests()


def test_step_api_abort_frees_blocks(smol_bf16):
    engine = smol_bf16.engine
    kv = engine.core.kv
    free = kv.pool.num_free_blocks
    engine.add_request("a", "Tell me a long story about dragons.", SamplingParams(max_tokens=200, ignore_eos=True))
    engine.add_request("b", "Count to one hundred.", SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert kv.pool.num_free_blocks < free
    engine.abort_request("a")
    engine.abort_request(["b", "unknown"])
    assert not engine.has_unfinished_requests()
    assert kv.pool.num_free_blocks == free


class _Recorder(StatLogger):
    def __init__(self):
        self.sched, self.iters = [], []

    def record(self, sched, it):
        self.sched.append(sched)
        self.iters.append(it)


def test_async_engine_streams_and_aborts_when_consumer_leaves(smol_bf16):
    engine = smol_bf16.engine
    recorder = _Recorder()
    engine.stat_loggers.append(recorder)
    kv = engine.core.kv

    async def main():
        aengine = AsyncLLMEngine(engine)
        aengine.start()
        try:
            params = SamplingParams(temperature=0, max_tokens=16)
            deltas = [o async for o in aengine.generate("The moon is", params)]
            assert deltas[-1].finished and len(deltas) >= 8
            text = "".join(d.outputs[0].text for d in deltas)
            # a consumer that stops early: the request is aborted and its blocks freed
            gen = aengine.generate("Write a very long essay.", SamplingParams(max_tokens=500, ignore_eos=True))
            async for _ in gen:
                break
            await gen.aclose()
            for _ in range(100):
                if not engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.02)
            assert not engine.has_unfinished_requests()
            assert kv.pool.num_free_blocks == kv.num_blocks
            return text
        finally:
            aengine.shutdown()

    try:
        text = asyncio.run(main())
    finally:
        engine.stat_loggers.remove(recorder)
    # (the offline API drives the same engine: only once the engine thread has stopped)
    assert text == smol_bf16.generate(["The moon is"], SamplingParams(temperature=0, max_tokens=16),
                                      use_tqdm=False)[0].outputs[0].text
    its = recorder.iters
    assert sum(i.num_generation_tokens for i in its) >= 17
    assert any(i.ttfts for i in its) and any(i.itls for i in its)
    fin = [f for i in its for f in i.finished]
    assert fin and fin[0].finish_reasons == ["length"] and fin[0].e2e_latency >= fin[0].ttft > 0
    assert fin[0].queue_time >= 0 and fin[0].num_prompt_tokens > 0
    s = recorder.sched[-1]
    assert s.kv_blocks_total == kv.num_blocks and s.prefix_queries >= s.prefix_hits >= 0


def test_async_engine_load_counts_what_the_core_has_not_taken_in(smol_bf16):
    """load() = the core's last reported load + the requests submitted since (what SLO admission reads)."""
    engine = smol_bf16.engine

    async def main():
        aengine = AsyncLLMEngine(engine)
        params = SamplingParams(temperature=0, max_tokens=5, n=2)
        streams = [aengine.generate([7] * 30, params), aengine.generate([8] * 20, SamplingParams(max_tokens=3))]
        load = aengine.load()  # the engine thread has not started: all of it is pending
        assert (load.num_running, load.num_waiting) == (0, 3)
        assert (load.waiting_prompt_tokens, load.waiting_decode_tokens) == (2 * 30 + 20, 2 * 5 + 3)
        aengine.start()
        try:
            seen = []
            for s in streams:
                async for _ in s:
                    seen.append(aengine.load())
            assert any(x.num_running for x in seen)  # the core's own report took over
            assert aengine.load() == type(load)()  # finished: nothing held, nothing pending
        finally:
            aengine.shutdown()

    asyncio.run(main())
