"""Block pool, KV cache manager and scheduler invariants, on the core alone (no model: sampled
tokens are random ids), under randomized mixes of arrivals, finishes, aborts and preemptions.
The runner's own per-request state, fed only the SchedulerOutput deltas, must match the core's."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill.core.block_pool import BlockPool
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.messages import CoreSamplingParams
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.scheduler_output import ModelRunnerOutput
from tokenmill.worker.request_state import RequestStates

BS = 4


def make_req(rid, n_prompt, max_tokens, rng=None, prefix=()):
    rng = rng or random.Random(0)
    ids = list(prefix) + [rng.randrange(1000) for _ in range(n_prompt - len(prefix))]
    return Request(str(rid), ids, CoreSamplingParams(), {999_999}, max_tokens, float(rid))


def check(sched: Scheduler, out=None):
    kv = sched.kv
    kv.pool.check_invariants()
    holders = {}
    for rid, blocks in kv.req_blocks.items():
        assert rid in sched.requests
        for b in blocks:
            holders[b.block_id] = holders.get(b.block_id, 0) + 1
    for b in kv.pool.blocks:
        assert b.ref_cnt == holders.get(b.block_id, 0) >= 0
    assert len(sched.running) <= sched.max_num_seqs
    for r in sched.running:  # computed tokens are covered by the request's blocks...
        assert len(kv.req_blocks.get(r.request_id, ())) * BS >= r.num_computed_tokens
    if out is not None:
        n = out.num_scheduled_tokens
        assert out.total_num_scheduled_tokens == sum(n.values()) <= sched.max_num_batched_tokens
        assert len(n) <= sched.max_num_seqs
        deltas = [r.req_id for r in out.scheduled_new_reqs] + [r.req_id for r in out.scheduled_cached_reqs]
        assert sorted(deltas) == sorted(n)  # one delta per scheduled request


def check_runner_state(sched: Scheduler, out, states: RequestStates):
    """The runner's view, built from deltas alone, equals the core's for every scheduled request."""
    for rid in out.num_scheduled_tokens:
        req, state = sched.requests[rid], states[rid]
        assert state.token_ids == req.all_token_ids and state.output_token_ids == req.output_token_ids
        assert state.block_ids == sched.kv.block_ids(req)
        assert state.num_computed_tokens == req.num_computed_tokens


def run_step(sched: Scheduler, rng, states: RequestStates | None = None):
    out = sched.schedule()
    check(sched, out)
    sampled = {}
    for rid, n in out.num_scheduled_tokens.items():
        req = sched.requests[rid]
        if req.num_computed_tokens + n == req.num_tokens:  # reaches the last token: samples
            sampled[rid] = [rng.randrange(1000)]
    if states is not None:
        states.apply(out, torch.device("cpu"))
        check_runner_state(sched, out, states)
        for rid, (token,) in sampled.items():  # the runner appends what it samples
            states[rid].append(token)
    sched.update(out, ModelRunnerOutput(sampled_token_ids=sampled))
    check(sched)
    for r in sched.running:  # ...with at most one partial block of waste
        assert len(kv_blocks(sched, r)) == -(-r.num_computed_tokens // BS)
    return out


def kv_blocks(sched, req):
    return sched.kv.req_blocks.get(req.request_id, [])


def test_block_pool_lru_and_refcounts():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"ha")
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free([b, a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 3
    pool.free([a])
    # empty blocks are handed out before the cached one is evicted
    got = pool.allocate(3)
    assert a not in got and pool.get_cached_block(b"ha") is a
    (evicted,) = pool.allocate(1)
    assert evicted is a and pool.get_cached_block(b"ha") is None and a.block_hash is None
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.free(got + [evicted])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([a])
    pool.check_invariants()
    assert pool.num_free_blocks == 4


def test_freed_cached_blocks_are_evicted_least_recently_used_first():
    pool = BlockPool(3)
    x, y, z = pool.allocate(3)
    for blk, h in ((x, b"x"), (y, b"y"), (z, b"z")):
        pool.cache_block(blk, h)
    pool.free([y])
    pool.free([x])
    pool.free([z])
    assert pool.allocate(1)[0] is y  # freed first, evicted first
    assert pool.get_cached_block(b"x") is x and pool.get_cached_block(b"z") is z


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_random_workload_never_leaks(caching, seed, policy):
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks=20, block_size=BS, enable_caching=caching)
    sched = Scheduler(kv, max_num_batched_tokens=rng.choice([8, 16, 48]), max_num_seqs=rng.choice([3, 4, 8]),
                      max_model_len=64, policy=policy, priority_aging=rng.choice([0.0, 5.0]))
    shared = [7] * 12
    next_id, states = 0, RequestStates()
    for step in range(400):
        if rng.random() < 0.3 and step < 300:
            n = rng.randint(1, 40)
            req = make_req(next_id, n, rng.randint(1, 64 - n), rng, shared[:min(n, 12)])
            req.priority = rng.randint(-2, 3) if policy == "priority" else 0
            sched.add_request(req)
            next_id += 1
        if rng.random() < 0.05 and sched.requests:
            sched.finish_requests([rng.choice(list(sched.requests))])
            check(sched)
        run_step(sched, rng, states)
    while sched.has_work():  # the last step tells the runner about the last finished requests
        run_step(sched, rng, states)
    assert kv.pool.num_free_blocks == kv.num_blocks
    assert not kv.req_blocks and not sched.running and not sched.waiting and not states
    assert sched.num_preemptions > 0  # the pool is small enough that preemption happened


def test_fcfs_and_no_starvation_under_constant_load():
    rng = random.Random(1)
    kv = KVCacheManager(num_blocks=64, block_size=BS)
    sched = Scheduler(kv, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=128)
    admitted, arrivals, finished_at = [], {}, {}
    next_id = 0
    for step in range(600):
        if step < 500 and len(sched.waiting) < 20:  # always more work than the engine can take
            req = make_req(next_id, rng.randint(4, 30), rng.randint(4, 20), rng)
            sched.add_request(req)
            arrivals[req.request_id] = step
            next_id += 1
        out = run_step(sched, rng)
        for rid in out.num_scheduled_tokens:
            if rid not in admitted:
                admitted.append(rid)
        for rid in arrivals:
            if rid not in sched.requests and rid not in finished_at:
                finished_at[rid] = step
    assert admitted == sorted(admitted, key=int)  # first admission in arrival order
    waits = [finished_at[r] - arrivals[r] for r in finished_at]
    assert len(finished_at) > 100 and max(waits) < 150  # everyone finishes, within a bounded wait


def test_decodes_are_never_stalled_by_a_long_prefill():
    kv = KVCacheManager(num_blocks=400, block_size=BS)
    sched = Scheduler(kv, max_num_batched_tokens=32, max_num_seqs=8, max_model_len=2048)
    rng = random.Random(2)
    short = [make_req(i, 8, 100, rng) for i in range(3)]
    for r in short:
        sched.add_request(r)
    run_step(sched, rng)  # all three prefill in one step
    sched.add_request(make_req(9, 1000, 10, rng))
    for _ in range(20):
        out = run_step(sched, rng)
        tokens = out.num_scheduled_tokens
        assert all(tokens.get(r.request_id) == 1 for r in short)  # every decode runs every step
        assert tokens.get("9") == 32 - 3  # the long prompt gets the rest of the budget, in chunks


def test_preemption_picks_the_most_recently_admitted_and_recomputes():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=40)
    rng, states = random.Random(3), RequestStates()
    a, b = make_req(0, 12, 20, rng), make_req(1, 12, 20, rng)
    sched.add_request(a)
    run_step(sched, rng, states)
    sched.add_request(b)
    preempted = []
    while not preempted:
        preempted = run_step(sched, rng, states).preempted_req_ids
    assert preempted == ["1"] and b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert sched.waiting.peek() is b and b.num_preemptions == 1
    # the runner keeps a preempted request's tokens (and generator) but not its freed blocks
    assert states["1"].block_ids == [] and states["1"].token_ids == b.all_token_ids and b.num_output_tokens > 0
    resumed = None
    while sched.has_work():
        out = run_step(sched, rng, states)
        resumed = resumed or next((r for r in out.scheduled_cached_reqs if r.resumed_from_preemption), None)
    assert resumed is not None and resumed.req_id == "1" and not states
    assert a.num_output_tokens == 20 and b.num_output_tokens == 20
    assert kv.pool.num_free_blocks == kv.num_blocks


def test_prefix_hits_share_blocks_and_leave_one_token_to_compute():
    kv = KVCacheManager(num_blocks=50, block_size=BS)
    sched = Scheduler(kv, max_num_batched_tokens=256, max_num_seqs=8, max_model_len=256)
    rng = random.Random(4)
    prefix = list(range(100, 120))  # 5 full blocks
    first = make_req(0, 24, 4, rng, prefix)
    sched.add_request(first)
    run_step(sched, rng)
    second, same = make_req(1, 30, 4, rng, prefix), make_req(2, 20, 4, rng, prefix)
    sched.add_request(second)
    sched.add_request(same)  # exactly the shared prefix: the last block is recomputed
    out = run_step(sched, rng)
    n = out.num_scheduled_tokens
    assert second.num_cached_tokens == 20 and n["1"] == 10
    assert same.num_cached_tokens == 16 and n["2"] == 4
    shared = kv.req_blocks["0"][:4]
    assert kv.req_blocks["1"][:4] == shared and all(b.ref_cnt == 3 for b in shared)
    assert kv.prefix_hits == 36 and kv.prefix_queries == 24 + 30 + 20
