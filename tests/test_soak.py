"""The CI soak (about 60 seconds of load, 2 minutes in all): saturation with mixed lengths, streaming and not, client
disconnects and aborts, then an open-loop overload at 10x capacity against --max-queue-len.
The 30-minute run is `python benchmarks/soak.py --minutes 30` (results in BENCHMARKS.md)."""

from __future__ import annotations

import pytest

from benchmarks.soak import SOAK_ARGS, run
from tests.server_utils import ServerProcess

pytestmark = pytest.mark.slow


def test_soak_then_overload():
    server = ServerProcess(*SOAK_ARGS).wait_ready()
    try:
        report = run(server, soak_seconds=30, overload_seconds=8, concurrency=48, seed=1)
        assert not report.server_errors, report.server_errors[:10]
        assert report.requests[200] > 50 and report.requests["disconnected"] > 0, report.requests
        growth = report.growth(warmup=10)
        assert growth["fds"] <= 0 and growth["threads"] <= 0, growth  # nothing leaks per request
        assert growth["rss_pct"] < 25, growth  # a gross-leak guard; the 30-minute run holds 5%
        o = report.overload
        assert o["statuses"].get(429, 0) > 0 and o["retry_after_missing"] == 0, o  # the excess is refused
        assert o["statuses"].get(200, 0) > 0 and o["recovered_after_s"] is not None, o
        assert "Traceback" not in server.log()
    finally:
        assert server.stop() == 0
