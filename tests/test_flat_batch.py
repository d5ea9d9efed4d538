"""One flat batch mixing decodes and prefill chunks (some after cached context) gives the same
logits as running each sequence alone."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import FlatBatchDriver
from tokenmill import LLM

TEXTS = ["The history of the Roman Empire spans many centuries, beginning with",
         "import numpy as np\nx = np.arange(10)\n",
         "Paris is the capital of France. Berlin is the capital of Germany. Madrid is the capital of " * 3,
         "Hi"]
EXTRA = [5, 6, 7, 8]  # tokens appended for the final all-decode step


def _alone(driver, tokens):
    req = driver.new("alone", tokens)
    (logits,) = driver.step([(req, len(tokens))])
    driver.free(req)
    return logits


def _mixed_vs_alone(llm):
    """Returns (mixed, alone) logits for every token computed in a mixed batch."""
    seqs = [llm.get_tokenizer().encode(t) for t in TEXTS]
    driver = FlatBatchDriver(llm.engine)
    ref = [_alone(driver, s) for s in seqs]
    a, b, c, d = (driver.new(str(i), s) for i, s in enumerate(seqs))
    # step 1: A's prompt but its last token, a first chunk of B and of C
    driver.step([(a, len(seqs[0]) - 1), (b, 7), (c, 40)])
    # step 2: A decodes; B and C continue after cached context; D prefills from scratch
    la, lb, lc, ld = driver.step([(a, 1), (b, len(seqs[1]) - 7), (c, len(seqs[2]) - 40), (d, len(seqs[3]))])
    pairs = [(la, ref[0][-1:]), (lb, ref[1][7:]), (lc, ref[2][40:]), (ld, ref[3])]
    # step 3: four decodes of different context lengths together
    for r, t in zip((a, b, c, d), EXTRA):
        r.all_token_ids.append(t)
    outs = driver.step([(a, 1), (b, 1), (c, 1), (d, 1)])
    pairs += [(out, _alone(driver, s + [t])[-1:]) for s, t, out in zip(seqs, EXTRA, outs)]
    driver.free(a, b, c, d)
    return pairs


def test_mixed_flat_batch_fp32(smol_fp32):
    for mixed, alone in _mixed_vs_alone(smol_fp32):
        torch.testing.assert_close(mixed, alone, atol=1e-4, rtol=0)


def _tv(a, b):
    """Total variation distance between next-token distributions, per position."""
    return (a.softmax(-1) - b.softmax(-1)).abs().sum(-1) / 2


def test_mixed_flat_batch_bf16(smol_bf16, smol_fp32):
    # bf16 kernels of different shapes round differently, so mixed and alone differ by bf16 noise
    # (up to ~0.15 total variation on this model). The bound that matters: batching adds no error
    # beyond bf16's own -- mixed is no farther from the fp32 truth than alone is, +0.02.
    truth = [alone for _, alone in _mixed_vs_alone(smol_fp32)]
    for (mixed, alone), t in zip(_mixed_vs_alone(smol_bf16), truth):
        assert _tv(mixed, t).max() <= _tv(alone, t).max() + 0.02


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_sdpa"])
@pytest.mark.parametrize("block_size", [1, 4, 32])
def test_mixed_flat_batch_other_block_sizes_and_backends(tiny_llama_dir, block_size, backend):
    llm = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory="64MiB", block_size=block_size,
              attention_backend=backend, progress=False)
    assert llm.engine.core.worker.backend.name == backend
    for mixed, alone in _mixed_vs_alone(llm):
        torch.testing.assert_close(mixed, alone, atol=1e-4, rtol=0)
