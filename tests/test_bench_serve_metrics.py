"""`tokenmill bench serve`'s arithmetic without a server: SLO parsing, goodput checked by hand,
and the arrival schedule's statistics."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tokenmill.bench.serve import arrival_times
from tokenmill.bench.serve_metrics import RequestRecord, meets_slo, parse_slo, summarize


def test_slo_parsing_and_hand_checked_goodput():
    assert parse_slo("ttft=500ms, tpot=0.1s,e2e=2,itl=50ms") == {"ttft": 0.5, "tpot": 0.1, "e2e": 0.002, "itl": 0.05}
    assert parse_slo(None) == {}
    for bad in ("ttft", "latency=1s", "ttft=-1ms", "ttft=1min"):
        with pytest.raises(ValueError):
            parse_slo(bad)

    def rec(i, ttft, e2e, out, gaps=()):
        r = RequestRecord(i, 10, out, sent_at=1.0, first_token_at=1.0 + ttft, end_at=1.0 + e2e, output_tokens=out)
        r.chunk_times = [r.first_token_at + sum(gaps[:k]) for k in range(len(gaps) + 1)]
        return r

    records = [rec(0, 0.2, 1.01, 10, [0.09] * 9),  # TTFT 200ms, TPOT 90ms: meets
               rec(1, 0.6, 1.0, 5),  # TTFT 600ms: misses
               rec(2, 0.1, 2.1, 11, [0.2] * 10),  # TPOT 200ms: misses
               rec(3, 0.3, 0.3, 1),  # one token: no TPOT, meets
               rec(4, 0.1, 0.19, 10, [0.01] * 4 + [0.04] + [0.01] * 4)]  # meets TPOT, one 40ms gap
    records.append(RequestRecord(5, 10, 4, sent_at=0.0, status=500, error="boom"))  # failed: never good
    slo = parse_slo("ttft=500ms,tpot=100ms")
    assert [meets_slo(r, slo) for r in records] == [True, False, False, True, True, False]
    s = summarize(records, duration_s=2.0, slo=slo)
    assert s["goodput"] == pytest.approx(3 / 2.0) and s["completed"] == 5 and s["failed"] == 1
    assert s["tpot_ms"]["count"] == 4 and s["tpot_ms"]["median"] == pytest.approx(95.0)  # of 10, 90, 100, 200
    # ITL: every gap counts, so 4 (one 40ms gap) misses; 1 and 3 have no gaps at all
    assert summarize(records, 2.0, parse_slo("itl=30ms"))["goodput"] == pytest.approx(2 / 2.0)
    assert summarize(records, 2.0, parse_slo("e2e=1s"))["goodput"] == pytest.approx(3 / 2.0)  # 1, 3 and 4
    assert summarize(records, 2.0)["goodput"] is None


def test_arrival_times_are_gamma_with_the_asked_mean_rate():
    for burstiness in (1.0, 0.25, 4.0):
        gaps = np.diff(arrival_times(4001, 50.0, burstiness, seed=1))
        assert gaps.mean() == pytest.approx(1 / 50, rel=0.1)
        # gamma with shape k: coefficient of variation 1/sqrt(k) (1 = Poisson, > 1 burstier)
        assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)
    assert arrival_times(3, math.inf, 1.0, seed=0) == [0.0, 0.0, 0.0]
