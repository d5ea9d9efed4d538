"""The scheduler's bookkeeping for speculation, checked directly on plain data: on rejection
num_computed_tokens moves back, rejected drafts' blocks are freed and the prefix cache only ever
hashes accepted tokens; drafts give way before anyone is preempted and stay within max_tokens."""

from __future__ import annotations

from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.messages import CoreSamplingParams
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.scheduler_output import ModelRunnerOutput


def _scheduler(num_blocks=8, block_size=4):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=True)
    return Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64), kv


def test_rejection_rewinds_and_frees_blocks_and_hashes_only_accepted_tokens():
    sched, kv = _scheduler()
    req = Request("r", [1, 2, 3, 4, 5, 6], CoreSamplingParams(temperature=0), [0], max_tokens=20, arrival_time=0)
    sched.add_request(req)
    out = sched.schedule()  # prefill: 6 tokens, 2 blocks
    sched.update(out, ModelRunnerOutput({"r": [7]}, spec_token_ids={"r": [8, 9, 10, 11, 12, 13]}))
    assert req.num_computed_tokens == 6 and req.spec_token_ids == [8, 9, 10, 11, 12, 13]
    out = sched.schedule()  # verify: the last token + 6 drafts -> positions 6..12: 4 blocks
    assert out.num_scheduled_tokens == {"r": 7} and out.scheduled_spec_decode_tokens == {"r": [8, 9, 10, 11, 12, 13]}
    assert len(kv.block_ids(req)) == 4
    # the target kept 8 and 9, then said 20 instead of 10: tokens 1..7, 8, 9, 20 (10 known)
    sched.update(out, ModelRunnerOutput({"r": [8, 9, 20]}))
    assert req.all_token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9, 20]
    assert req.num_computed_tokens == 9  # KV of 1..9 is valid; 20's is computed next step
    assert len(kv.block_ids(req)) == 3  # the 4th block only held rejected drafts
    assert sched.stats().spec_decoding.num_accepted_tokens == 2
    assert sched.stats().spec_decoding.num_accepted_tokens_per_pos == [1, 1, 0, 0, 0, 0]
    out = sched.schedule()
    assert out.num_kept_blocks == {"r": 3}  # the runner cuts its block table too
    assert out.num_scheduled_tokens == {"r": 1}
    # only blocks full of accepted tokens are in the prefix cache: [1..4], [5..8]
    assert len(kv.pool.cached) == 2
    assert kv._num_hashed["r"] == 2


def test_drafts_give_way_before_anyone_is_preempted():
    sched, kv = _scheduler(num_blocks=3)
    a = Request("a", [1, 2, 3], CoreSamplingParams(temperature=0), [0], max_tokens=20, arrival_time=0)
    b = Request("b", [4, 5, 6], CoreSamplingParams(temperature=0), [0], max_tokens=20, arrival_time=1)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.update(out, ModelRunnerOutput({"a": [7], "b": [8]}, spec_token_ids={"a": [1] * 8, "b": [2] * 8}))
    out = sched.schedule()  # 3 blocks: drafts of 8 would need 3 blocks each
    assert not out.preempted_req_ids
    assert sum(len(d) for d in out.scheduled_spec_decode_tokens.values()) < 16


def test_drafts_stay_within_max_tokens():
    sched, _ = _scheduler()
    req = Request("r", [1, 2, 3], CoreSamplingParams(temperature=0), [0], max_tokens=3, arrival_time=0)
    sched.add_request(req)
    out = sched.schedule()
    sched.update(out, ModelRunnerOutput({"r": [4]}, spec_token_ids={"r": [5, 6, 7, 8]}))
    out = sched.schedule()
    assert out.scheduled_spec_decode_tokens == {"r": [5]}  # 1 sampled + 1 draft + 1 bonus = 3


def test_a_request_grows_to_max_model_len_in_a_pool_that_holds_just_that():
    """A draft model's lookahead slots end at max_model_len, where drafting stops: at 15 of 16 tokens,
    3 slots past them asked for a fifth block of a pool of 4 blocks of 4, and the request waited forever."""
    kv = KVCacheManager(4, 4, enable_caching=False)
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=16, num_lookahead_slots=3)
    req = Request("r", list(range(1, 14)), CoreSamplingParams(temperature=0), [0], max_tokens=3, arrival_time=0)
    sched.add_request(req)
    out = sched.schedule()  # 13 tokens + 3 slots: all 4 blocks
    assert out.num_scheduled_tokens == {"r": 13}
    sched.update(out, ModelRunnerOutput({"r": [14]}, spec_token_ids={"r": [15, 16, 17]}))
    out = sched.schedule()  # the last token + 1 draft (max_model_len), no slot past it
    assert out.num_scheduled_tokens == {"r": 2} and out.scheduled_spec_decode_tokens == {"r": [15]}
    sched.update(out, ModelRunnerOutput({"r": [15, 16]}))
    assert req.is_finished and req.num_tokens == 16 and kv.pool.num_free_blocks == 4
