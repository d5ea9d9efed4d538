"""The offline API: `LLM(model=None, **engine_args).generate(prompts, params)` and `.chat(...)`."""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Sequence

from tqdm import tqdm

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.errors import EngineStepError
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int]
Params = SamplingParams | Sequence[SamplingParams] | None


class LLM:
    def __init__(self, model: str | None = None, progress: bool = True, **engine_args):
        self.engine = LLMEngine.from_engine_args(model=model, progress=progress, **engine_args)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], params: Params = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for one prompt (text or token ids) or a list; returns outputs in prompt order.
        `priority`: one per prompt, lower served first (needs scheduling_policy="priority")."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run([(p, True) for p in prompts], params, use_tqdm, priority)

    def chat(self, messages: list[dict] | Sequence[list[dict]], params: Params = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template: str | None = None,
             continue_final_message: bool = False) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} messages) or a list of them.
        `continue_final_message`: the model goes on with the last message (with add_generation_prompt=False)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        proc = self.engine.processor
        texts = [proc.render_chat(c, add_generation_prompt, chat_template, continue_final_message)
                 for c in conversations]
        # the template already holds the special tokens (BOS etc.)
        return self._run([(t, False) for t in texts], params, use_tqdm)

    def _run(self, prompts: list[tuple[Prompt, bool]], params, use_tqdm: bool,
             priority: Sequence[int] | None = None) -> list[RequestOutput]:
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(priority)} priorities")
        # validate every prompt before submitting any, so bad input leaves nothing behind
        processed = [self.engine.process(str(next(self._ids)), prompt, _final_only(p), add_special_tokens=add,
                                         priority=prio)
                     for (prompt, add), p, prio in zip(prompts, params, priority)]
        self.engine.add_processed(*processed)
        order = [p.request_id for p in processed]
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(order), desc="Processed prompts", unit=" req", disable=not use_tqdm,
                   dynamic_ncols=True)
        t0, out_tokens = time.monotonic(), 0
        try:
            while self.engine.has_unfinished_requests():
                outputs = self.engine.step()
                failed = self.engine.take_failed()
                if failed:
                    rid, why = next(iter(failed.items()))
                    raise EngineStepError(f"request {rid} failed: {why}", list(failed))
                for out in outputs:
                    if out.finished:
                        results[out.request_id] = out
                        out_tokens += sum(len(o.token_ids) for o in out.outputs)
                        bar.update(1)
                        bar.set_postfix_str(f"output {out_tokens / (time.monotonic() - t0):.1f} tok/s")
        except BaseException:
            self.engine.abort_request(order)  # leave the engine clean (Ctrl-C, errors)
            raise
        finally:
            bar.close()
        return [results[rid] for rid in order]


def _final_only(p: SamplingParams) -> SamplingParams:
    """The offline API returns finished requests only: no per-step outputs to build."""
    if p.output_kind == RequestOutputKind.FINAL_ONLY:
        return p
    p = copy.copy(p)
    p.output_kind = RequestOutputKind.FINAL_ONLY
    return p
