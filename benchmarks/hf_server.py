"""A naive OpenAI-compatible server around Hugging Face transformers: the baseline that tokenmill is
compared with (same client, `tokenmill bench serve`, against both).

Deliberately what a straightforward implementation does: ONE request at a time (an asyncio lock
around generation; the others wait in line), a token-by-token loop with the KV cache in
past_key_values, no batching, no paged or prefix cache. Greedy at temperature 0, else
temperature / top_p sampling. Streams SSE like vLLM/tokenmill (text chunks, a usage chunk on
request, [DONE]).

    python benchmarks/hf_server.py --port 8100          # the embedded SmolLM2 GGUF, bf16
    tokenmill bench serve --base-url http://127.0.0.1:8100 --concurrency 1,4 --ignore-eos

Endpoints: POST /v1/completions, /v1/chat/completions, /tokenize, /detokenize; GET /v1/models, /health.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
import uuid
from pathlib import Path

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


class Generator:
    """The model, its tokenizer, and a lock so that only one request generates at a time."""

    def __init__(self, model_path: str | None, dtype: torch.dtype):
        from hf_reference import load_hf_model

        from tokenmill.model.loader import load_tokenizer, resolve_model

        source = resolve_model(model_path)
        self.name = source.name
        self.model = load_hf_model(dtype, model_path)  # dense weights (see hf_reference.py)
        self.tokenizer = load_tokenizer(source)
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = (set(eos if isinstance(eos, list) else [eos]) | {self.tokenizer.eos_token_id}) - {None}
        self.max_len = getattr(self.model.config, "max_position_embeddings", 2048)
        self.lock = asyncio.Lock()

    @torch.inference_mode()
    def run(self, ids: list[int], max_tokens: int, temperature: float, top_p: float, ignore_eos: bool,
            seed: int | None, emit, stop: threading.Event) -> None:
        """The decode loop (on a worker thread): emit(token) per new token."""
        rng = torch.Generator().manual_seed(seed) if seed is not None else None
        out = self.model(input_ids=torch.tensor([ids]), use_cache=True)
        for i in range(max_tokens):
            logits = out.logits[0, -1].float()
            if temperature <= 0:
                token = int(logits.argmax())
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                if top_p < 1.0:
                    sorted_p, order = probs.sort(descending=True)
                    drop = sorted_p.cumsum(0) - sorted_p > top_p  # keep the smallest set reaching top_p
                    probs[order[drop]] = 0
                token = int(torch.multinomial(probs, 1, generator=rng))
            emit(token)
            if stop.is_set() or i == max_tokens - 1 or (token in self.eos_ids and not ignore_eos):
                return
            out = self.model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)

    async def stream(self, ids: list[int], params: dict):
        """Yields (new text, token count so far, finish reason or None); holds the lock throughout."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        stop = threading.Event()
        async with self.lock:
            def work():
                try:
                    self.run(ids, emit=lambda t: loop.call_soon_threadsafe(queue.put_nowait, t), stop=stop, **params)
                    loop.call_soon_threadsafe(queue.put_nowait, None)
                except BaseException as e:  # noqa: BLE001 - handed to the request
                    loop.call_soon_threadsafe(queue.put_nowait, e)

            worker = loop.run_in_executor(None, work)
            tokens, sent = [], ""
            try:
                while (item := await queue.get()) is not None:
                    if isinstance(item, BaseException):
                        raise item
                    tokens.append(item)
                    text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                    if text.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for the rest
                        text = sent
                    last = len(tokens) == params["max_tokens"] or (item in self.eos_ids and not params["ignore_eos"])
                    finish = None if not last else ("stop" if item in self.eos_ids else "length")
                    yield text[len(sent):], len(tokens), finish
                    sent = text
            finally:
                stop.set()  # a client that went away stops the loop; the next request waits for it
                await worker


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}}, status)


def build_app(gen: Generator) -> FastAPI:
    app = FastAPI(title="hf-baseline")

    def sse(obj: dict) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def params(body: dict) -> dict:
        def get(name, default, kind):
            value = body.get(name)
            return default if value is None else kind(value)

        return {"max_tokens": get("max_completion_tokens", None, int) or get("max_tokens", 16, int),
                "temperature": get("temperature", 1.0, float), "top_p": get("top_p", 1.0, float),
                "ignore_eos": get("ignore_eos", False, bool), "seed": get("seed", None, int)}

    async def respond(body: dict, ids: list[int], chat: bool):
        try:
            p = params(body)
        except (TypeError, ValueError) as e:
            return _error(400, f"bad sampling parameter: {e}")
        if p["max_tokens"] < 1 or len(ids) + p["max_tokens"] > gen.max_len:
            return _error(400, f"prompt ({len(ids)} tokens) + max_tokens ({p['max_tokens']}) must be in "
                               f"[1, {gen.max_len}]")
        rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str, finish, first: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text, "finish_reason": finish}
            return {"id": rid, "object": kind, "created": created, "model": gen.name, "choices": [choice]}

        def usage(n_out: int) -> dict:
            return {"prompt_tokens": len(ids), "completion_tokens": n_out, "total_tokens": len(ids) + n_out}

        if body.get("stream"):
            async def events():
                n_out = 0
                if chat:
                    yield sse(chunk("", None, first=True))
                async for text, count, finish in gen.stream(ids, p):
                    n_out = count
                    yield sse(chunk(text, finish))
                if (body.get("stream_options") or {}).get("include_usage"):
                    yield sse({"id": rid, "object": kind, "created": created, "model": gen.name, "choices": [],
                               "usage": usage(n_out)})
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        text, n_out, finish_reason = "", 0, None
        async for piece, count, finish in gen.stream(ids, p):
            text, n_out, finish_reason = text + piece, count, finish
        choice = {"index": 0, "finish_reason": finish_reason}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": gen.name, "choices": [choice], "usage": usage(n_out)}

    async def read_json(request: Request) -> dict:
        try:
            body = await request.json()
        except ValueError:
            body = None
        return body if isinstance(body, dict) else {}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]  # one prompt in a list
        if isinstance(prompt, str) and prompt:
            ids = gen.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = prompt
        else:
            return _error(400, "prompt must be one non-empty string or list of token ids")
        return await respond(body, ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await read_json(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return _error(400, "messages must be a non-empty list")
        text = gen.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return await respond(body, gen.tokenizer.encode(text, add_special_tokens=False), chat=True)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await read_json(request)
        if isinstance(body.get("messages"), list):
            text = gen.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
            tokens = gen.tokenizer.encode(text, add_special_tokens=False)
        elif isinstance(body.get("prompt"), str):
            tokens = gen.tokenizer.encode(body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", True)))
        else:
            return _error(400, "give prompt (a string) or messages")
        return {"tokens": tokens, "count": len(tokens), "max_model_len": gen.max_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        tokens = (await read_json(request)).get("tokens")
        if not isinstance(tokens, list):
            return _error(400, "tokens must be a list of token ids")
        return {"prompt": gen.tokenizer.decode(tokens)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": gen.name, "object": "model", "owned_by": "hf-baseline",
                                            "max_model_len": gen.max_len}]}

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--model", default=None, help="A tokenmill model name, .gguf or HF folder [default: SmolLM2]")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32",
                        help="float32 is the faster one for a single stream on CPU")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads [default: all cores]")
    args = parser.parse_args()
    # run as a script from a checkout, tokenmill need not be installed: it is one directory up
    sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # weights come from local files only
    torch.set_num_threads(args.threads)
    import uvicorn

    gen = Generator(args.model, getattr(torch, args.dtype))
    print(f"hf baseline: serving {gen.name} on http://{args.host}:{args.port}", flush=True)
    uvicorn.run(build_app(gen), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
