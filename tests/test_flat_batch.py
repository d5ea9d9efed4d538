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
        # GEMM row order noise (oneDNN held to AVX2 gave 1.1e-4 on a logit of 4.2), as against transformers
        torch.testing.assert_close(mixed, alone, atol=1e-4, rtol=1e-5)


def _tv(a, b):
    """Total variation distance between next-token distributions, per position."""
    return (a.softmax(-1) - b.softmax(-1)).abs().sum(-1) / 2


PASSAGES = [
    "The history of the Roman Empire spans many centuries, beginning with the founding of the city and ending "
    "with the fall of Constantinople. Its roads, laws and language shaped Europe for a thousand years after.",
    "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n    pivot = xs[0]\n    left = [x for x in xs[1:] "
    "if x < pivot]\n    right = [x for x in xs[1:] if x >= pivot]\n    return quicksort(left) + [pivot] + "
    "quicksort(right)\n",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. It happens in the chloroplasts "
    "of plant cells, where chlorophyll absorbs mostly red and blue light and reflects green.",
    "Q: What is the boiling point of water at sea level?\nA: 100 degrees Celsius, or 212 degrees Fahrenheit.\n"
    "Q: And on the summit of Mount Everest?\nA: About 70 degrees Celsius, because the air pressure is lower.",
] * 3


def _alone_all(driver, seqs):
    return [_alone(driver, s) for s in seqs]


def _random_chunks(driver, seqs, seed):
    """Every sequence fed in random chunk sizes, several sequences per step, single-token steps
    (decodes) mixed in. Returns each sequence's logits, position by position."""
    import random

    rng = random.Random(seed)
    reqs = [driver.new(str(i), s) for i, s in enumerate(seqs)]
    done, got = [0] * len(seqs), [[] for _ in seqs]
    while any(d < len(s) for d, s in zip(done, seqs)):
        items = [(i, 1 if rng.random() < 0.4 else rng.randint(2, 40)) for i in range(len(seqs))
                 if done[i] < len(seqs[i]) and rng.random() < 0.7]
        items = sorted(((i, min(n, len(seqs[i]) - done[i])) for i, n in items), key=lambda x: x[1] != 1)
        if not items:
            continue
        for (i, n), logits in zip(items, driver.step([(reqs[i], n) for i, n in items])):
            got[i].append(logits)
            done[i] += n
    driver.free(*reqs)
    return [torch.cat(g) for g in got]


@pytest.mark.slow
def test_batching_adds_no_bf16_error(smol_bf16, smol_fp32):
    """bf16 kernels of different shapes round differently, so a token's logits computed in a mixed
    batch differ from alone by bf16 noise (up to ~0.13 total variation at single positions of this
    model, either way). What matters is that batching adds no error beyond bf16's own: over ~500
    positions, batched logits are on average no farther from the fp32 truth than alone ones."""
    tok = smol_fp32.get_tokenizer()
    seqs = [tok.encode(p)[:n] for p, n in zip(PASSAGES, [20, 35, 50, 64, 30, 41, 57, 28, 45, 60, 33, 48])]
    truth = _alone_all(FlatBatchDriver(smol_fp32.engine), seqs)
    driver = FlatBatchDriver(smol_bf16.engine)
    alone = torch.cat([_tv(a, t) for a, t in zip(_alone_all(driver, seqs), truth)])
    for seed in range(2):
        mixed = torch.cat([_tv(m, t) for m, t in zip(_random_chunks(driver, seqs, seed), truth)])
        assert mixed.mean() <= alone.mean() * 1.1 + 1e-3, (mixed.mean(), alone.mean())


def test_batch_invariant_flat_batch_is_bitwise_alone():
    """In batch-invariant mode every token's logits equal alone's bit for bit, whatever the mix,
    or the engine refuses the mode at start-up (on a CPU where it cannot hold)."""
    from tokenmill.errors import ConfigError

    try:
        llm = LLM(dtype="bfloat16", batch_invariant=True, kv_cache_memory="64MiB", max_model_len=512,
                  progress=False)
    except ConfigError as e:
        assert "batch_invariant is not available on this CPU" in str(e)
        return
    tok = llm.get_tokenizer()
    seqs = [tok.encode(p)[:n] for p, n in zip(PASSAGES, [20, 35, 50, 64, 30, 41])]
    driver = FlatBatchDriver(llm.engine)
    alone = _alone_all(driver, seqs)
    for mixed, ref in zip(_random_chunks(driver, seqs, seed=0), alone):
        assert torch.equal(mixed, ref)
    for mixed, ref in _mixed_vs_alone(llm):
        assert torch.equal(mixed, ref)


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_sdpa"])
@pytest.mark.parametrize("block_size", [1, 4, 32])
def test_mixed_flat_batch_other_block_sizes_and_backends(tiny_llama_dir, block_size, backend):
    llm = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory="64MiB", block_size=block_size,
              attention_backend=backend, progress=False)
    assert llm.engine.core.worker.backend.name == backend
    for mixed, alone in _mixed_vs_alone(llm):
        # GEMM row order noise (oneDNN held to AVX2 gave 1.1e-4 on a logit of 4.2), as against transformers
        torch.testing.assert_close(mixed, alone, atol=1e-4, rtol=1e-5)
