"""Talk to `tokenmill serve` (e.g. `make serve`) with the official openai client."""

from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused-unless-the-server-has---api-key")
model = client.models.list().data[0].id

reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name three rivers."}],
                                       max_tokens=64, temperature=0)
print(reply.choices[0].message.content)

stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count to five."}],
                                        max_tokens=64, stream=True, stream_options={"include_usage": True})
for chunk in stream:
    if chunk.choices:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
    elif chunk.usage:
        print(f"\n[{chunk.usage.completion_tokens} tokens]")
