"""Priority scheduling (`--scheduling-policy priority`): the waiting queue's order, the preemption
victim, the starvation bound of aging, on the real Scheduler; then the engine end to end (order of
service, greedy results unchanged, bad input)."""

from __future__ import annotations

import random

import pytest

from tests.test_core_invariants import BS, make_req, run_step
from tokenmill import LLM, SamplingParams
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import RequestStatus
from tokenmill.core.request_queue import priority_key
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.scheduler_output import ModelRunnerOutput
from tokenmill.errors import ConfigError, InvalidRequestError
from tokenmill.worker.request_state import RequestStates


def sched_with(policy="priority", aging=0.0, num_blocks=200, max_num_seqs=1, budget=64):
    return Scheduler(KVCacheManager(num_blocks, BS), budget, max_num_seqs, 256, policy, aging)


def req(rid, priority, arrival, prompt=8, max_tokens=4, rng=None):
    r = make_req(rid, prompt, max_tokens, rng or random.Random(rid))
    r.priority, r.arrival_time = priority, float(arrival)
    return r


def admission_order(sched, rng):
    order = []
    while sched.has_work():
        out = run_step(sched, rng)
        order += [r.req_id for r in out.scheduled_new_reqs]
    return order


def test_waiting_queue_serves_lower_priority_first_then_arrival():
    rng = random.Random(0)
    sched = sched_with()
    for rid, prio in enumerate([3, 1, 2, 1, -1]):
        sched.add_request(req(rid, prio, arrival=rid))
    assert admission_order(sched, rng) == ["4", "1", "3", "2", "0"]
    fcfs = sched_with("fcfs")
    for rid, prio in enumerate([3, 1, 2, 1, -1]):
        fcfs.add_request(req(rid, prio, arrival=rid))
    assert admission_order(fcfs, rng) == ["0", "1", "2", "3", "4"]  # fcfs ignores priorities


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_takes_the_lowest_priority(policy):
    """Three requests grow in lockstep until the pool runs out: fcfs preempts the most recently
    admitted (c), priority the lowest priority (a, admitted first)."""
    rng, states = random.Random(1), RequestStates()
    sched = sched_with(policy, num_blocks=12, max_num_seqs=3)
    for rid, prio in enumerate([5, 0, 1]):
        sched.add_request(req(rid, prio, rid, prompt=8, max_tokens=30))
    preempted = []
    while not preempted:
        out = run_step(sched, rng, states)  # checks the runner's state built from the deltas
        preempted = out.preempted_req_ids
    victim = "0" if policy == "priority" else "2"
    assert preempted == [victim] and sched.requests[victim].status == RequestStatus.PREEMPTED
    assert sorted(out.num_scheduled_tokens) == sorted({"0", "1", "2"} - {victim})
    while sched.has_work():  # everyone still finishes
        run_step(sched, rng, states)
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks


@pytest.mark.parametrize("seed", range(4))
def test_every_victim_is_the_lowest_ranked_running_request(seed):
    """Random arrivals, priorities and lengths on a small pool (decodes first, then prefill chunks,
    so a victim is often already in the step's batch and its part is undone): each step's victims
    are the lowest-ranked requests that were running."""
    rng, states = random.Random(seed), RequestStates()
    aging = rng.choice([0.0, 3.0])
    sched = sched_with(aging=aging, num_blocks=24, max_num_seqs=6, budget=rng.choice([8, 16, 32]))
    rank = {}
    victims = 0
    for step in range(300):
        if step < 200 and rng.random() < 0.4:
            r = req(step, rng.randint(0, 4), step / 4, prompt=rng.randint(2, 30), max_tokens=rng.randint(1, 30),
                    rng=rng)
            rank[r.request_id] = priority_key(r, aging)
            sched.add_request(r)
        before = sorted((rank[r.request_id] for r in sched.running), reverse=True)
        out = run_step(sched, rng, states)
        if out.preempted_req_ids:
            victims += len(out.preempted_req_ids)
            worst = sorted((rank[v] for v in out.preempted_req_ids), reverse=True)
            assert worst == before[:len(worst)]
    while sched.has_work():
        run_step(sched, rng, states)
    assert victims > 0 and sched.kv.pool.num_free_blocks == sched.kv.num_blocks


@pytest.mark.parametrize("seed", range(40))
def test_prefix_hits_read_only_kv_a_step_wrote(seed):
    """Shared prefixes on a small pool under priority preemption. A step writes the K/V of the
    tokens it schedules; every prefix-cache hit must land on blocks holding exactly that context.
    Half the arrivals continue another request's text so far, as a chat's next turn does. (A
    victim whose part of a step is undone had its blocks registered as full at scheduling: they
    must leave the cache, not serve a later hit with K/V nobody wrote.)"""
    rng = random.Random(seed)
    sched = sched_with(num_blocks=rng.choice([24, 40]), max_num_seqs=rng.choice([6, 10]),
                       budget=rng.choice([8, 16, 32]))
    written: dict[int, list] = {}  # block id -> per slot, the context (tokens up to it) written there
    prefixes = [[rng.randrange(1000) for _ in range(3 * BS)] for _ in range(rng.choice([2, 8, 40]))]
    hits = 0
    for step in range(400):
        if step < 300 and rng.random() < 0.5:
            prefix = rng.choice(prefixes)
            if sched.requests and rng.random() < 0.5:  # a follow-up turn: another request's text so far
                prefix = rng.choice(list(sched.requests.values())).all_token_ids[:31]
            r = make_req(step, rng.randint(len(prefix) + 1, 32), rng.randint(1, 30), rng, prefix=prefix)
            r.priority, r.arrival_time = rng.randint(0, 4), step / 4
            sched.add_request(r)
        if not sched.has_work():
            continue
        out = sched.schedule()
        sampled = {}
        for rid, n in out.num_scheduled_tokens.items():
            req = sched.requests[rid]
            ids = sched.kv.block_ids(req)
            for pos in range(req.num_computed_tokens, req.num_computed_tokens + n):
                written.setdefault(ids[pos // BS], [None] * BS)[pos % BS] = tuple(req.all_token_ids[:pos + 1])
            if req.num_computed_tokens + n == req.num_tokens:
                sampled[rid] = [rng.randrange(1000)]
        # the step writes before it reads: a hit may be on a block another request fills in this step
        admitted = [(c.req_id, c.new_block_ids, c.num_computed_tokens) for c in out.scheduled_cached_reqs
                    if c.resumed_from_preemption]
        for rid, block_ids, num_hit in [(n.req_id, n.block_ids, n.num_computed_tokens)
                                        for n in out.scheduled_new_reqs] + admitted:
            tokens = sched.requests[rid].all_token_ids
            for pos in range(num_hit):
                slots = written.get(block_ids[pos // BS])
                assert slots is not None and slots[pos % BS] == tuple(tokens[:pos + 1]), \
                    f"step {step}: request {rid} hit unwritten K/V at position {pos}"
            hits += num_hit // BS
        sched.update(out, ModelRunnerOutput(sampled_token_ids=sampled))
    assert hits > 0 and sched.num_preemptions > 0


def test_an_undone_step_leaves_no_unwritten_block_in_the_prefix_cache():
    """allocate_slots registers the blocks a step will fill; when that step's part is undone (a
    priority victim already scheduled), freeing with what was written takes them out again."""
    kv = KVCacheManager(8, BS)
    r = make_req(1, 3 * BS, 4)
    kv.allocate_slots(r, 3 * BS)  # the step would fill 3 blocks: registered now
    hashes = r.update_block_hashes(BS)
    assert all(kv.pool.get_cached_block(h) is not None for h in hashes[:3])
    kv.free(r, num_written=BS)  # only the first block's K/V was written (an earlier step)
    assert kv.pool.get_cached_block(hashes[0]) is not None
    assert kv.pool.get_cached_block(hashes[1]) is None and kv.pool.get_cached_block(hashes[2]) is None
    assert kv.pool.num_free_blocks == 8
    kv.pool.check_invariants()


def starve(aging: float, low_priority: int = 3, spacing: float = 0.5, steps: int = 400):
    """A request of `low_priority` arrives at t=0 behind a stream of priority-0 requests (one slot,
    one new arrival every `spacing` seconds per step, each served in one step): returns (the step it
    was admitted or None, the arrival times of the requests admitted before it)."""
    rng = random.Random(2)
    sched = sched_with(aging=aging)
    sched.add_request(req(0, low_priority, 0.0, max_tokens=1))
    arrival, ahead = {}, []
    for step in range(steps):
        arrival[str(step + 1)] = step * spacing + 0.25
        sched.add_request(req(step + 1, 0, arrival[str(step + 1)], max_tokens=1))
        for new in run_step(sched, rng).scheduled_new_reqs:
            if new.req_id == "0":
                return step, ahead
            ahead.append(arrival[new.req_id])
    return None, ahead


def test_aging_bounds_starvation():
    # strict priorities: a stream of higher-priority arrivals starves the request
    step, _ = starve(aging=0.0)
    assert step is None
    # with aging A, exactly the requests arriving within (3 - 0) x A of it overtake it
    for aging in (2.0, 10.0):
        step, ahead = starve(aging)
        assert step is not None and max(ahead) < 3 * aging <= max(ahead) + 0.5


@pytest.fixture(scope="module")
def prio_llm():
    return LLM(dtype="float32", quantization="none", progress=False, kv_cache_memory="256MiB", max_model_len=2048,
               scheduling_policy="priority", max_num_seqs=1)


def test_engine_serves_by_priority_and_greedy_results_do_not_change(prio_llm, smol_fp32):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The sky is",
               "Water boils at"]
    params = SamplingParams(temperature=0, max_tokens=12)
    priority = [2, 0, 3, -1, 1]
    outs = prio_llm.generate(prompts, params, use_tqdm=False, priority=priority)
    served = sorted(range(len(prompts)), key=lambda i: outs[i].metrics.first_scheduled_time)
    assert served == sorted(range(len(prompts)), key=lambda i: priority[i])  # one slot: in priority order
    ref = smol_fp32.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]


def test_priority_under_preemption_keeps_greedy_results(smol_fp32):
    """A KV pool of 320 tokens for ~500 tokens of work: the lowest priorities are preempted and
    recomputed, and greedy tokens equal those of an unconstrained engine."""
    llm = LLM(dtype="float32", quantization="none", progress=False, kv_cache_memory=20 * 16 * 46080, max_model_len=256,
              scheduling_policy="priority", priority_aging=0)
    prompts = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    priority = [i % 3 for i in range(8)]
    outs = llm.generate(prompts, params, use_tqdm=False, priority=priority)
    preemptions = [sum(o.metrics.num_preemptions for o, p in zip(outs, priority) if p == level) for level in range(3)]
    assert preemptions[2] > 0 and preemptions[0] <= preemptions[2], preemptions
    ref = smol_fp32.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert llm.engine.core.kv.pool.num_free_blocks == llm.engine.core.kv.num_blocks


def test_bad_priorities(prio_llm, smol_fp32):
    with pytest.raises(InvalidRequestError, match="scheduling policy") as e:
        smol_fp32.generate(["Hi"], SamplingParams(max_tokens=1), use_tqdm=False, priority=[1])
    assert e.value.param == "priority"
    with pytest.raises(InvalidRequestError, match="integer"):
        prio_llm.generate(["Hi"], SamplingParams(max_tokens=1), use_tqdm=False, priority=[1.5])
    with pytest.raises(ValueError, match="priorities"):
        prio_llm.generate(["Hi", "Ho"], SamplingParams(max_tokens=1), use_tqdm=False, priority=[1])
    with pytest.raises(ConfigError, match="scheduling_policy"):
        LLM(scheduling_policy="lifo", progress=False)
    with pytest.raises(ConfigError, match="priority_aging"):
        LLM(priority_aging=-1, progress=False)
