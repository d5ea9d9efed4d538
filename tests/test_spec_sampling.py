"""Sampled outputs with speculation are distributed as without it (end to end, the real model).

A repetitive prompt makes the n-gram proposer draft at every step. For 2000 requests with and
without speculation (no seeds: a seeded request draws as the plain sampler does, token for token,
test_spec_outputs.py; these take the rejection rule), the first token and the fourth token (which
follows verified drafts) are compared with Pearson's chi-square test of homogeneity at significance
0.001, for temperature 1 and for top-p 0.9. Both engines run bf16 with `batch_invariant=True` (the
GGUF's packed weights): a verification row's logits are then bit for bit a plain decode row's, so
both sample from exactly the same distributions, at a third of fp32's time. The same test flags a
run whose acceptance rule is deliberately biased (every draft kept), so it can fail. Each engine's
random stream is its own seeded generator, so a run is reproducible.
"""

from __future__ import annotations

import gc
from collections import Counter

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.worker.spec_decode import rejection_sampler

from .test_rejection_sampler import chi2_critical

# not adaptive: every step drafts, whatever the policy would measure at 128 requests
NGRAM = ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1, '
         '"adaptive": false}')
# 33 tokens: two full 16-token KV blocks and one more. Every request after the first reads the two
# blocks from the prefix cache and computes one prompt token, so a sample costs 4 token forwards
# (not 9, as with 22 tokens): the statistics are about the sampler, not the prompt's length.
PROMPT = "a b c d e " * 6 + "a b c"
N = 2000
ARGS = dict(batch_invariant=True, kv_cache_memory="256MiB", max_model_len=128, max_num_seqs=128, progress=False)


def homogeneity(a: Counter, b: Counter, min_expected: float = 5.0) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom of two samples over shared categories (rare
    categories pooled so that every expected count is >= min_expected)."""
    na, nb = sum(a.values()), sum(b.values())
    total = a + b
    common = [c for c, n in total.items() if n * min(na, nb) / (na + nb) >= min_expected]
    rows = [(a[c], b[c]) for c in common]
    rest = (na - sum(r[0] for r in rows), nb - sum(r[1] for r in rows))
    if sum(rest):
        rows.append(rest)
    stat = 0.0
    for oa, ob in rows:
        n = oa + ob
        ea, eb = n * na / (na + nb), n * nb / (na + nb)
        stat += (oa - ea) ** 2 / ea + (ob - eb) ** 2 / eb
    return stat, len(rows) - 1


def _sample(llm, **params) -> tuple[Counter, Counter]:
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPT)
    ps = [SamplingParams(max_tokens=4, ignore_eos=True, **params) for _ in range(N)]
    outs = llm.generate([ids] * N, ps, use_tqdm=False)
    first = Counter(o.outputs[0].token_ids[0] for o in outs)
    fourth = Counter(o.outputs[0].token_ids[3] for o in outs)
    return first, fourth


@pytest.fixture(scope="module")
def runs():
    """Both samples of both engines; the speculating engine stays, for the biased run."""
    out = {}
    for name, spec in (("plain", None), ("spec", NGRAM)):
        llm = LLM(speculative_config=spec, **ARGS)
        out[name] = {"t1": _sample(llm, temperature=1.0), "p09": _sample(llm, temperature=1.0, top_p=0.9)}
        if spec:
            core = llm.engine.core
            assert core.kv.prefix_hits >= 2 * (2 * N - 2) * 16  # the prompt's two blocks came from the cache
            assert core.stats().spec_decoding.num_accepted_tokens > N  # drafts were verified and kept, a lot
            out["spec_llm"] = llm
        del llm
        gc.collect()
    yield out
    out.clear()
    gc.collect()


@pytest.mark.slow
@pytest.mark.parametrize("params", ["t1", "p09"])
@pytest.mark.parametrize("position", [0, 1], ids=["first-token", "fourth-token"])
def test_speculation_keeps_the_distribution(runs, params, position):
    stat, df = homogeneity(runs["plain"][params][position], runs["spec"][params][position])
    assert df >= 2
    assert stat < chi2_critical(df), f"chi2 {stat:.1f} >= {chi2_critical(df):.1f} (df {df})"


@pytest.mark.slow
def test_a_biased_acceptance_rule_is_caught(runs, monkeypatch):
    def keep_every_draft(p, drafts, generator, q=None, as_plain=False):
        return list(drafts) + [rejection_sampler.draw(p[len(drafts)], generator)]

    monkeypatch.setattr(rejection_sampler, "verify_sampled", keep_every_draft)  # looked up at each step
    _, fourth = _sample(runs["spec_llm"], temperature=1.0)
    stat, df = homogeneity(runs["plain"]["t1"][1], fourth)
    assert stat > chi2_critical(df), "the test cannot tell a biased acceptance rule"
