"""lm-evaluation-harness (`lm_eval --model local-completions`) against `tokenmill serve`, on the two
local tasks in examples/lm_eval (a loglikelihood task and a generation task, from JSONL files; the
hub is not needed). Every loglikelihood it reports must equal the offline `LLM`'s prompt logprobs of
the same tokens, and every generation the offline greedy text."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server_utils import ServerProcess
from tokenmill import SamplingParams

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("lm_eval") is None,
    reason="lm-eval is not installed (`make install-ecosystem`, or pip install -e '.[ecosystem]')")]


def run_lm_eval(server: ServerProcess, out: Path, *model_args: str, limit: int = 8) -> tuple[dict, str]:
    """The documented command (docs/ecosystem.md), from the repository root; returns the logged samples
    per task, and lm_eval's output."""
    args = ",".join(["model=SmolLM2-135M-Instruct", f"base_url={server.base_url}/completions", "num_concurrent=1",
                     *model_args])
    cmd = [str(Path(sys.executable).parent / "lm_eval"), "--model", "local-completions", "--model_args", args,
           "--tasks", "tokenmill_capitals,tokenmill_opposites", "--include_path", "examples/lm_eval",
           "--limit", str(limit), "--log_samples", "--output_path", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TQDM_DISABLE": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tokenmill_capitals" in proc.stdout and "exact_match" in proc.stdout  # the results table
    samples = {}
    for task in ("tokenmill_capitals", "tokenmill_opposites"):
        (path,) = out.glob(f"*/samples_{task}_*.jsonl")
        samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(samples[task]) == limit
    return samples, proc.stdout + proc.stderr


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """How lm-eval splits a causal (context, continuation) pair into tokens: trailing spaces of the
    context move to the continuation, the whole is encoded once and split at the context's length."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    ctx = tokenizer.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx):]


@pytest.fixture(scope="module")
def fp32_server():
    srv = ServerProcess("--dtype", "float32", "--quantization", "none").wait_ready()
    yield srv
    srv.stop()


def test_lm_eval_loglikelihoods_and_generations_match_the_offline_engine(fp32_server, smol_fp32, tmp_path):
    # no tokenizer given: lm-eval finds /tokenizer_info and tokenizes through the server's /tokenize
    tokenizer = smol_fp32.engine.tokenizer
    samples, log = run_lm_eval(fp32_server, tmp_path)
    assert "Auto-detected remote tokenizer support" in log
    diffs = []
    for sample in samples["tokenmill_capitals"]:
        for i, args in enumerate(sample["arguments"].values()):
            ctx, cont = encode_pair(tokenizer, args["arg_0"], args["arg_1"])
            (out,) = smol_fp32.generate(ctx + cont, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0),
                                        use_tqdm=False)
            offline = [out.prompt_logprobs[len(ctx) + k][t].logprob for k, t in enumerate(cont)]
            loglik, greedy = sample["resps"][i][0]
            diffs.append(abs(float(loglik) - sum(offline)))
            # greedy: every continuation token is the offline top-1 of its position
            assert (greedy == "True") == all(out.prompt_logprobs[len(ctx) + k][t].rank == 1
                                              for k, t in enumerate(cont)), args
    print("largest |server - offline| loglikelihood:", max(diffs))
    assert len(diffs) == 32 and max(diffs) == 0.0, diffs  # fp32, one request at a time on both sides: bitwise
    for sample in samples["tokenmill_opposites"]:
        context = sample["arguments"]["gen_args_0"]["arg_0"]
        (out,) = smol_fp32.generate(tokenizer.encode(context, add_special_tokens=False),
                                    SamplingParams(max_tokens=8, temperature=0, stop=["\n", "."]), use_tqdm=False)
        assert sample["resps"][0][0] == out.outputs[0].text, context
