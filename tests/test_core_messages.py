"""The plain data at the core's boundaries: every type round-trips through msgspec (so the core and
the runner can live in other processes), the front end builds it, and a step's k tokens are
appended one by one with the stop conditions checked after each."""

from __future__ import annotations

import msgspec
import pytest

from tokenmill import SamplingParams
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.messages import (
    CoreSamplingParams,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    PromptLogprobs,
    SchedulerStats,
    TokenLogprobs,
)
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.scheduler_output import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput

PARAMS = CoreSamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.5,
                            frequency_penalty=-0.25, repetition_penalty=1.1, logit_bias={5: -100.0, 7: 2.5},
                            seed=1234, min_tokens=2, stop_token_ids=[3, 4], ignore_eos=True, logprobs=2,
                            prompt_logprobs=0)
LP = TokenLogprobs([11, 11, 12], [-0.1, -0.1, -2.5], 1)

SAMPLES = [
    EngineCoreRequest("r1", [1, 2, 3], PARAMS, [2], 16, 123.5, b"tenant"),
    EngineCoreRequest("r2", [9], CoreSamplingParams(), [], 1, 0.0),
    EngineCoreOutputs([EngineCoreOutput("r1", [11, 12], [LP, LP], PromptLogprobs(1, [LP]), "stop", 12, 16, 1.25, 2),
                       EngineCoreOutput("r2")], 99.0, SchedulerStats(1, 2, 0.5, 10, 20, 100, 48, 3)),
    SchedulerOutput([NewRequestData("r1", [1, 2, 3], PARAMS, [2], [0, 1], 0)],
                    [CachedRequestData("r0", True, [4, 5, 6], 16), CachedRequestData("r3", False, [], 40)],
                    {"r0": 1, "r3": 1, "r1": 3}, 5, ["r4"], ["r5"]),
    ModelRunnerOutput({"r0": [7, 8, 9]}, {"r0": [LP, LP, LP]}, {"r1": PromptLogprobs(1, [LP, LP])}),
]


@pytest.mark.parametrize("obj", SAMPLES, ids=lambda o: type(o).__name__)
def test_round_trip_through_msgpack(obj):
    buf = msgspec.msgpack.encode(obj)
    assert msgspec.msgpack.decode(buf, type=type(obj)) == obj
    assert type(msgspec.msgpack.decode(buf, type=type(obj))) is type(obj)


def test_core_params_carry_what_the_core_acts_on():
    p = SamplingParams(n=3, temperature=0.5, top_k=10, seed=9, stop=["x"], stop_token_ids=[4], min_tokens=1,
                       logit_bias={"7": 1}, logprobs=1, max_tokens=20)
    core = CoreSamplingParams.from_params(p)
    assert (core.temperature, core.top_k, core.seed, core.stop_token_ids, core.logit_bias) == (0.5, 10, 9, [4],
                                                                                             {7: 1})
    assert not core.greedy and CoreSamplingParams.from_params(SamplingParams(temperature=0)).greedy
    assert not hasattr(core, "stop") and not hasattr(core, "n")  # front-end concerns stay there
    # the defaults are SamplingParams's: a default request crosses the boundary as an empty map
    assert CoreSamplingParams.from_params(SamplingParams()) == CoreSamplingParams()
    assert msgspec.msgpack.encode(CoreSamplingParams.from_params(SamplingParams())) == b"\x80"


def test_front_end_builds_engine_core_requests(smol_bf16):
    engine = smol_bf16.engine
    p = engine.process("x", "Hello there", SamplingParams(n=3, seed=5, max_tokens=7, temperature=1.0))
    assert [c.request_id for c in p.children] == ["0_x", "1_x", "2_x"]  # n > 1: children, a front-end concept
    assert [c.sampling_params.seed for c in p.children] == [5, 6, 7]
    assert all(c.max_tokens == 7 and c.prompt_token_ids == p.prompt_token_ids for c in p.children)
    assert engine.tokenizer.eos_token_id in p.children[0].eos_token_ids
    for c in p.children:
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(c), type=EngineCoreRequest) == c


def _scheduler():
    return Scheduler(KVCacheManager(num_blocks=16, block_size=4), 64, 4, 64)


def _step(sched, tokens):
    out = sched.schedule()
    (rid,) = out.num_scheduled_tokens
    return sched.update(out, ModelRunnerOutput({rid: tokens}, {rid: [LP] * len(tokens)}))


def test_a_step_may_yield_several_tokens_and_a_stop_drops_the_rest():
    sched = _scheduler()
    sched.add_request(Request("a", [1, 2, 3], CoreSamplingParams(), {2}, 10, 0.0))
    (out,) = _step(sched, [7, 8])
    assert out.new_token_ids == [7, 8] and len(out.new_logprobs) == 2 and out.finish_reason is None
    (out,) = _step(sched, [9, 2, 5])  # EOS second: the third token is not the request's
    assert out.new_token_ids == [9, 2] and len(out.new_logprobs) == 2
    assert out.finish_reason == "stop" and not sched.has_unfinished()
    assert sched.has_work() and sched.schedule().finished_req_ids == ["a"] and not sched.has_work()


def test_length_and_min_tokens_are_checked_after_every_token():
    sched = _scheduler()
    params = CoreSamplingParams(min_tokens=3, stop_token_ids=[4])
    sched.add_request(Request("a", [1, 2, 3], params, {2}, 4, 0.0))
    (out,) = _step(sched, [4, 2, 6])  # stop tokens before min_tokens do not stop
    assert out.new_token_ids == [4, 2, 6] and out.finish_reason is None
    (out,) = _step(sched, [7, 8])  # max_tokens=4 reached after the first
    assert out.new_token_ids == [7] and out.finish_reason == "length"
