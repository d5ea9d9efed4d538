"""Everything of the official `openai` client that tokenmill serves, one call each, with what came back.

    tokenmill serve &            # or make serve
    python examples/openai_surface.py [http://127.0.0.1:8000]

Prints one line per feature; exits non-zero at the first one that does not behave as OpenAI's API does.
"""

import sys

import httpx
import openai

root = (sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000").rstrip("/")
client = openai.OpenAI(base_url=root + "/v1", api_key="unused-unless-the-server-has---api-key", max_retries=0)
chat = [{"role": "user", "content": "Name a colour."}]


def show(feature: str, result) -> None:
    print(f"{feature:<34} {result}")


model = client.models.list().data[0].id
show("models.list / retrieve", f"{model} (owned_by={client.models.retrieve(model).owned_by})")

r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
show("completions", f"{r.choices[0].text!r} finish={r.choices[0].finish_reason} usage={r.usage.total_tokens}")

r = client.completions.create(model=model, prompt=[[504, 3458, 282, 4649, 314]], max_tokens=4, temperature=0)
show("completions, token-id prompt", f"{r.choices[0].text!r} prompt_tokens={r.usage.prompt_tokens}")

r = client.completions.create(model=model, prompt=["Red,", "One,"], max_tokens=4, temperature=0.8, n=2, seed=1)
assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
show("completions, 2 prompts x n=2", [c.text for c in sorted(r.choices, key=lambda c: c.index)])

r = client.completions.create(model=model, prompt="1, 2, 3,", max_tokens=3, temperature=0, logprobs=2)
lp = r.choices[0].logprobs
show("completions, logprobs=2", [(t, round(v, 3)) for t, v in zip(lp.tokens, lp.token_logprobs)])

r = client.completions.create(model=model, prompt="The sky is blue", max_tokens=0, echo=True, logprobs=1)
lp = r.choices[0].logprobs
assert lp.token_logprobs[0] is None and len(lp.tokens) == r.usage.prompt_tokens
show("completions, echo (loglikelihood)", f"sum of prompt logprobs {sum(lp.token_logprobs[1:]):.3f}")

text = "".join(c.choices[0].text for c in client.completions.create(
    model=model, prompt="Once upon a time", max_tokens=8, temperature=0, stream=True) if c.choices)
show("completions, stream", repr(text))

r = client.chat.completions.create(model=model, messages=chat, max_tokens=10, temperature=0)
show("chat.completions", f"{r.choices[0].message.content!r} role={r.choices[0].message.role}")

r = client.chat.completions.create(model=model, messages=chat, max_tokens=3, temperature=0, logprobs=True,
                                   top_logprobs=2)
show("chat, logprobs + top_logprobs=2", [(e.token, [t.token for t in e.top_logprobs]) for e in
                                         r.choices[0].logprobs.content])

r = client.chat.completions.create(model=model, messages=chat, max_tokens=6, temperature=1.0, n=3, seed=7)
show("chat, n=3 seed=7", [c.message.content for c in r.choices])

chunks = list(client.chat.completions.create(model=model, messages=chat, max_tokens=8, temperature=0, stream=True,
                                             stream_options={"include_usage": True}))
streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
show("chat, stream + include_usage", f"{streamed!r} usage={chunks[-1].usage.completion_tokens}")

r = client.chat.completions.create(model=model, messages=chat, max_tokens=12, stop=["\n"], temperature=0,
                                   extra_body={"top_k": 1, "repetition_penalty": 1.1})
show("chat, stop + vLLM extras (extra_body)", repr(r.choices[0].message.content))

# tokenize / detokenize are vLLM's routes at the server root: the client's generic post() reaches them
root_client = client.with_options(base_url=root)
tokens = root_client.post("/tokenize", body={"prompt": "Hello world"}, cast_to=httpx.Response).json()
back = root_client.post("/detokenize", body={"tokens": tokens["tokens"]}, cast_to=httpx.Response).json()
assert back["prompt"] == "Hello world"
show("tokenize / detokenize", f"{tokens['tokens']} -> {back['prompt']!r}")

try:
    client.completions.create(model="no-such-model", prompt="x")
except openai.NotFoundError as e:
    show("errors: unknown model", f"NotFoundError {e.status_code}: {e.body['message']}")
try:
    client.completions.create(model=model, prompt="x", temperature=-1)
except openai.BadRequestError as e:
    show("errors: bad parameter", f"BadRequestError {e.status_code} param={e.body['param']}")
