"""`tokenmill generate "prompt"` (streams a completion) and `tokenmill chat` (interactive chat)."""

from __future__ import annotations

import argparse
import sys
import uuid

from tokenmill.entrypoints.cli.args import add_engine_args, engine_config_from_args
from tokenmill.sampling_params import RequestOutputKind, SamplingParams


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    """(Sampling is reproducible through the engine's --seed.)"""
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--stop", action="append", default=None, help="Stop string (repeatable).")


def sampling_from_args(args) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          stop=args.stop, output_kind=RequestOutputKind.DELTA)


def register(sub) -> None:
    p = sub.add_parser("generate", help="Complete a prompt, streaming the text to the terminal.")
    p.add_argument("prompt", nargs="?", help="The prompt (read from stdin if omitted).")
    p.add_argument("--chat", action="store_true", help="Send the prompt as a user message, in the chat template.")
    add_sampling_args(p, max_tokens=128)
    add_engine_args(p)
    p.set_defaults(func=run_generate)

    c = sub.add_parser("chat", help="Chat with the model in the terminal (its chat template).")
    c.add_argument("--system", default=None, help="System prompt.")
    add_sampling_args(c, max_tokens=512)
    add_engine_args(c)
    c.set_defaults(func=run_chat)


def _engine(args):
    from tokenmill.engine.llm_engine import LLMEngine

    return LLMEngine(engine_config_from_args(args), progress=sys.stderr.isatty())


def _stream(engine, prompt, params: SamplingParams, add_special_tokens: bool, out=sys.stdout) -> str:
    rid = uuid.uuid4().hex
    engine.add_request(rid, prompt, params, add_special_tokens=add_special_tokens)
    text = []
    try:
        while engine.has_unfinished_requests():
            for o in engine.step():
                delta = o.outputs[0].text if o.outputs else ""
                text.append(delta)
                out.write(delta)
                out.flush()
    except KeyboardInterrupt:
        engine.abort_request(rid)
        out.write(" [interrupted]")
    out.write("\n")
    return "".join(text)


def run_generate(args) -> int:
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    engine = _engine(args)
    add_special = True
    if args.chat:
        prompt = engine.processor.render_chat([{"role": "user", "content": prompt}])
        add_special = False
    _stream(engine, prompt, sampling_from_args(args), add_special)
    return 0


def run_chat(args) -> int:
    engine = _engine(args)
    params = sampling_from_args(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print(f"Chatting with {engine.served_model_name}. /reset clears the history, /exit or Ctrl-D quits.",
          file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        prompt = engine.processor.render_chat(messages)
        reply = _stream(engine, prompt, params, add_special_tokens=False)
        messages.append({"role": "assistant", "content": reply})
