"""The CI fuzz run (about 1000 cases, under 3 minutes): schemathesis against the server's own
/openapi.json with every check, with --api-key off and on, and the mutation fuzzer. The long run
is `python benchmarks/fuzz.py --cases 10000`."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from benchmarks.fuzz import FUZZ_ARGS, run_mutations, run_schemathesis, server_problems
from tests.server_utils import ServerProcess

pytestmark = pytest.mark.slow
SEED = 20261122  # fixed: CI is reproducible; benchmarks/fuzz.py draws a new seed each run


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(*FUZZ_ARGS).wait_ready()
    yield srv
    srv.stop()


def test_schemathesis_finds_nothing(server):
    code, report, cases = run_schemathesis(server.url, max_examples=50, seed=SEED)
    assert code == 0, report[-20_000:]
    assert cases >= 500, report[-3000:]


def test_mutation_fuzzer_finds_nothing(server):
    result = asyncio.run(run_mutations(server.url, cases=300, concurrency=8, seed=SEED))
    assert not result.failures, "\n".join(result.failures[:20])
    assert result.statuses[200] > 20 and result.statuses[400] > 100, result.summary()


def test_server_is_clean_after_fuzzing(server):
    assert server_problems(server) == []


def test_schemathesis_with_api_key():
    srv = ServerProcess(*FUZZ_ARGS, "--api-key", "fuzz-key").wait_ready()
    try:
        code, report, cases = run_schemathesis(srv.url, max_examples=12, api_key="fuzz-key", seed=SEED)
        assert code == 0, report[-20_000:]
        assert cases >= 100, report[-3000:]
        schema = httpx.get(srv.url + "/openapi.json").json()
        assert schema["paths"]["/v1/completions"]["post"]["security"] == [{"bearer": []}]
        assert "security" not in schema["paths"]["/health"]["get"]
        assert server_problems(srv) == []
    finally:
        srv.stop()
