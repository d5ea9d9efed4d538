"""Offline batch generation with the Python API (no server)."""

from tokenmill import LLM, SamplingParams

llm = LLM()  # the embedded SmolLM2-135M-Instruct; pass a folder, a .gguf or a short name to change it
prompts = ["The capital of France is", "def fibonacci(n):", "Three facts about the moon:"]
params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=48, seed=0)
for out in llm.generate(prompts, params):
    print(repr(out.prompt), "->", repr(out.outputs[0].text))

chat = llm.chat([{"role": "user", "content": "Give me a haiku about tea."}],
               SamplingParams(temperature=0, max_tokens=64))
print(chat[0].outputs[0].text)
