"""Speculative decoding with n-gram drafts (prompt lookup), offline: the same greedy output, fewer
model passes when the output repeats the input, and each request's acceptance figures.

With Qwen2.5-Coder (`make install-qwen`) a draft model works the same way:
    LLM("qwen2.5-coder-1.5b", speculative_config={"model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 5,
                                                  "quantization": "int4"})
"""

import time

from tokenmill import LLM, SamplingParams

code = '''def area(width, height):
    return width * height


def perimeter(width, height):
    return 2 * (width + height)
'''
prompt = f"<|im_start|>user\nAdd a docstring to each function of this code:\n{code}<|im_end|>\n<|im_start|>assistant\n"
params = SamplingParams(temperature=0, max_tokens=96)

for spec in (None, {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 2}):
    llm = LLM(speculative_config=spec, progress=False)
    llm.generate([prompt], params, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    tok_s = len(out.outputs[0].token_ids) / (time.perf_counter() - t0)
    m = out.metrics
    figures = (f", acceptance {m.spec_acceptance_rate:.0%}, {m.spec_mean_acceptance_length:.2f} tokens a pass"
               if m.num_drafts else "")
    print(f"{'n-gram' if spec else 'plain'}: {tok_s:.0f} tok/s{figures}")
    print(out.outputs[0].text)
    del llm
