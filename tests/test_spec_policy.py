"""The speculation policy follows measured speed per batch-size bucket (synthetic timings)."""

from __future__ import annotations

from tokenmill.core.spec_policy import SpecPolicy


def _run(policy: SpecPolicy, num_running: int, on_rate: float, off_rate: float, steps: int = 160,
         admitted: tuple[int, int] = (0, 0)) -> float:
    """Steps at the given true speeds (tokens/s); returns the fraction of steps that speculated."""
    on = 0
    for _ in range(steps):
        s = policy.speculate(num_running, admitted=admitted)
        on += s
        policy.observe(num_running, s, 1.0, int(on_rate if s else off_rate))
    return on / steps


def test_speculates_where_faster_and_not_where_slower():
    p = SpecPolicy(explore_every=16)
    assert _run(p, 1, on_rate=30, off_rate=10) > 0.9  # one stream: speculation pays
    frac = _run(p, 64, on_rate=90, off_rate=100)  # 64 streams: batching already uses the compute
    assert frac <= 1 / 16 + 2 / 160  # only the exploration steps (and the first measurement)
    assert p.bucket(1) != p.bucket(64)


def test_follows_a_change_of_workload():
    p = SpecPolicy(explore_every=8)
    _run(p, 4, on_rate=50, off_rate=10)
    assert _run(p, 4, on_rate=10, off_rate=50, steps=200) < 0.3


def test_no_drafts_while_prompts_wait_or_prefill():
    """Steps with prefill work are compute-bound: drafts would take prompt tokens' place."""
    p = SpecPolicy()
    assert _run(p, 1, on_rate=30, off_rate=10) > 0.9
    assert not p.speculate(1, prefill_pending=True)
    assert p.speculate(1)


def test_exploration_backs_off_while_it_confirms_the_choice():
    """A settled choice is re-tried ever more rarely (up to 1 in max_explore_every steps)."""
    p = SpecPolicy(explore_every=16, max_explore_every=64)
    _run(p, 64, on_rate=85, off_rate=100, steps=200)
    assert _run(p, 64, on_rate=85, off_rate=100, steps=1024) <= 17 / 1024  # 1 in 16 would be 64


def test_a_try_that_is_never_measured_lapses():
    p = SpecPolicy(explore_every=4)
    _run(p, 8, on_rate=10, off_rate=50, steps=20)
    tries = sum(p.speculate(8) for _ in range(40))  # no observe: every try lapses and is made again
    assert tries >= 4


def test_a_near_tie_does_not_speculate():
    """Within the margin speculation only makes requests uneven (a tail of small batches later)."""
    p = SpecPolicy(explore_every=16, max_explore_every=64)
    assert _run(p, 16, on_rate=103, off_rate=100, steps=320) <= 1 / 16 + 2 / 320
    assert _run(SpecPolicy(), 16, on_rate=110, off_rate=100) > 0.8


def test_a_draining_batch_starts_without_speculation_and_still_finds_it():
    p = SpecPolicy(explore_every=16)
    _run(p, 16, on_rate=80, off_rate=100)  # bucket of 16: speculation slower
    assert not p.speculate(8)  # bucket of 8, unmeasured: the larger bucket's choice first
    p.observe(8, False, 1.0, 100)
    first = [p.speculate(8) for _ in range(16)]
    assert not any(first[:15]) and first[15]  # speculation tried after explore_every steps
    p.observe(8, True, 1.0, 300)
    assert _run(p, 8, on_rate=300, off_rate=100) > 0.9


def test_a_bucket_forgets_once_its_requests_have_all_finished():
    """The tail of a concurrent run (its last request alone, speculation slower there) must not
    decide for the next workload: once the requests it measured are gone, a bucket measures anew."""
    p = SpecPolicy(explore_every=16, max_explore_every=64)
    _run(p, 1, on_rate=50, off_rate=100, steps=100, admitted=(63, 63))  # request 63, the last of 64
    assert p.best(1) is False
    assert _run(p, 1, on_rate=50, off_rate=100, steps=64, admitted=(63, 63)) <= 2 / 64  # still that request
    # a new request on a slow verdict would wait up to 64 steps for a try and then average it in;
    # forgotten, speculation is measured in its first step and kept
    first = p.speculate(1, admitted=(64, 64))
    assert first and p.best(1) is None
    p.observe(1, first, 1.0, 300)
    assert _run(p, 1, on_rate=300, off_rate=100, steps=60, admitted=(64, 64)) > 0.9


def test_a_busy_batch_keeps_its_measurements_while_requests_overlap():
    p = SpecPolicy(explore_every=16)
    _run(p, 64, on_rate=80, off_rate=100, steps=100, admitted=(0, 63))
    for i in range(1, 64):  # requests finish and new ones join, one at a time: never a full turnover
        p.speculate(64, admitted=(i, 63 + i))
        assert p.best(p.bucket(64)) is False
    p.speculate(64, admitted=(64, 127))  # every request measured before has finished
    assert p.best(p.bucket(64)) is None


def test_draft_length_follows_the_measured_cost_per_row_count():
    """One stream: the drafts are cut to the length with the most expected tokens per second; a
    size the kernels run cheaply (here 16 rows, a whole number of 8-row tiles) is found and used."""
    cost_ms = {q: 6 + 3 * q for q in range(1, 18)}
    cost_ms[16] = 42.0  # cheaper than 15 rows (51 ms) and 17 (57 ms)
    p = SpecPolicy()
    chosen = []
    for _ in range(40):
        n = p.draft_length(1, 16)
        chosen.append(n)
        tokens = 1 + n if n < 16 else 16  # every draft kept, except the 16th
        p.observe(1, n > 0, cost_ms[1 + n] / 1e3, tokens, 1 + n, n)
    assert chosen[0] == 16  # the full length is measured first
    assert chosen[-10:] == [15] * 10
    assert p.draft_length(2, 16) == 16  # with several requests running, drafts are not cut


def test_draft_length_is_shorter_when_drafts_are_mostly_rejected():
    p = SpecPolicy()
    for _ in range(60):
        n = p.draft_length(1, 8)
        p.observe(1, n > 0, (6 + 3 * n) / 1e3, 1 + min(n, 1), 1 + n, n)  # only the first draft is ever kept
    assert p.draft_length(1, 8) <= 2


def test_draft_length_costs_are_forgotten_with_the_request_that_measured_them():
    """A long request makes long verifications expensive (attention over its context); the next,
    short request must measure them again rather than inherit the verdict."""
    p = SpecPolicy()
    late = {q: 6 + 9 * q for q in range(1, 10)}  # late in a long request: each extra row is costly
    for _ in range(30):
        n = p.draft_length(1, 8)
        p.speculate(1, admitted=(0, 0))
        p.observe(1, n > 0, late[1 + n] / 1e3, 1 + min(n, 2), 1 + n, n)  # two drafts kept at most
    assert p.draft_length(1, 8) < 8
    p.speculate(1, admitted=(1, 1))  # request 0 finished: a new one, short
    assert p.draft_length(1, 8) == 8  # measured again, from the full length
    early = {q: 6 + 0.5 * q for q in range(1, 10)}
    for _ in range(20):
        n = p.draft_length(1, 8)
        p.speculate(1, admitted=(1, 1))
        p.observe(1, n > 0, early[1 + n] / 1e3, 1 + n, 1 + n, n)  # every draft kept
    assert p.draft_length(1, 8) == 8


def _timed(policy: SpecPolicy, num_running: int, on_s: float, off_s: float, steps: int = 100) -> float:
    """Steps of the given lengths (a verification yields 3 tokens per request); returns the fraction
    of steps that speculated."""
    on = 0
    for _ in range(steps):
        s = policy.speculate(num_running)
        on += s
        policy.observe(num_running, s, on_s if s else off_s, num_running * (3 if s else 1))
    return on / steps


def test_a_draft_model_tries_speculation_only_where_rows_are_nearly_free():
    """A draft model's try first catches up over every token decoded without it, so with several
    requests it is tried only where a plain step costs at most twice a one-request step."""
    p = SpecPolicy(costly_tries=True)
    assert _timed(p, 16, on_s=0.1, off_s=0.062) == 0  # no one-request step measured yet
    assert _timed(p, 1, on_s=0.03, off_s=0.018) > 0.9
    assert _timed(p, 16, on_s=0.1, off_s=0.062) == 0  # 16 rows cost 3.4x one: never tried
    assert _timed(p, 4, on_s=0.045, off_s=0.029) > 0.8  # 4 rows cost 1.6x one: tried, and it pays
    assert _timed(SpecPolicy(), 16, on_s=0.1, off_s=0.062) > 0.9  # n-gram tries are cheap: tried


def test_a_draft_model_is_not_tried_where_its_verification_would_be_compute_bound():
    """With k = 5 a verification takes 6 rows per request: 2 requests (12) are tried, 4 (24, past
    max_try_rows) are not, however cheap their plain steps."""
    p = SpecPolicy(costly_tries=True, rows_per_request=6)
    assert _timed(p, 1, on_s=0.03, off_s=0.018) > 0.9
    assert _timed(p, 2, on_s=0.04, off_s=0.02) > 0.8  # tried, and it pays
    assert _timed(p, 4, on_s=0.045, off_s=0.029) == 0


def test_a_draft_model_keeps_a_slow_verdict_for_the_next_requests():
    """A draft model's try catches up over the prompt and every token decoded without it: where its
    requests measured speculation slower, the next ones start without it, and the wait to the next
    try runs on across them; a try that finds speculation faster switches it on."""
    p = SpecPolicy(costly_tries=True, explore_every=16, max_explore_every=64)
    _run(p, 1, on_rate=50, off_rate=100, steps=100, admitted=(0, 0))
    assert p.best(1) is False
    tries = 0
    for r in range(1, 9):  # eight more requests of 24 steps: 192 steps, 1 try per 64 at most
        tries += 24 * _run(p, 1, on_rate=50, off_rate=100, steps=24, admitted=(r, r))
    assert 1 <= tries <= 2 * (192 // 64 + 1)  # a try is a spec step and its confirming repeat
    assert not p.speculate(1, admitted=(9, 9))  # a new request starts without speculation
    # the workload changes (speculation now pays): found at the next try, and used
    assert _run(p, 1, on_rate=300, off_rate=100, steps=200, admitted=(9, 9)) > 0.5
    # without a draft model a new request measures both choices anew (n-gram tries are cheap)
    q = SpecPolicy(explore_every=16, max_explore_every=64)
    _run(q, 1, on_rate=50, off_rate=100, steps=100, admitted=(0, 0))
    assert q.speculate(1, admitted=(1, 1))


def test_a_fast_verdict_carries_over_to_the_next_requests():
    """Where speculation measured faster, the bucket keeps its averages when its requests finish: a
    new request starts with it and the wait to the next try runs on. Measured anew, every request at
    one stream spent a step without it and tries 16 and 48 steps in, each a whole verification's
    tokens lost. Speculation is measured every step it runs, so a changed workload turns it off."""
    p = SpecPolicy(explore_every=16, max_explore_every=64)
    _run(p, 1, on_rate=300, off_rate=100, steps=100, admitted=(0, 0))
    assert p.best(1) is True
    off = 0
    for r in range(1, 9):  # eight more requests of 24 steps: 192 steps, 1 try per 64 at most
        off += round(24 * (1 - _run(p, 1, on_rate=300, off_rate=100, steps=24, admitted=(r, r))))
    assert off <= 192 // 64 + 1  # forgetting the verdict: 2 or 3 steps without speculation a request
    assert p.speculate(1, admitted=(9, 9))  # a new request starts with speculation
    # the workload changes (speculation now costs): its average falls within a few steps
    assert _run(p, 1, on_rate=50, off_rate=100, steps=200, admitted=(9, 9)) < 0.5
