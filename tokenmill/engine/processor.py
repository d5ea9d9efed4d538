"""Input processing: tokenize, validate against the model's limits, and build EngineCoreRequests
(n > 1 becomes n child requests that share the prompt's KV blocks through the prefix cache)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from tokenmill.core.messages import CoreSamplingParams, EngineCoreRequest
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams


@dataclass
class ProcessedRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[EngineCoreRequest]
    arrival_time: float


def child_id(parent_id: str, index: int, n: int) -> str:
    return parent_id if n == 1 else f"{index}_{parent_id}"


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, max_logprobs: int,
                 eos_token_ids: set[int], chat_template: str | None = None, priority_scheduling: bool = False):
        self.tokenizer = tokenizer
        self.priority_scheduling = priority_scheduling
        self.chat_template = chat_template  # overrides the model's
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.eos_token_ids = sorted(eos_token_ids)
        self._max_token_chars: int | None = None

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    chat_template: str | None = None, continue_final_message: bool = False,
                    **template_kwargs) -> str:
        """`continue_final_message`: the last message left open, for the model to go on with (an
        assistant's prefill), as vLLM's and transformers' flag."""
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list", param="messages")
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true (set "
                                      "add_generation_prompt to false to continue the last message)",
                                      param="continue_final_message")
        norm = []
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise InvalidRequestError("each message needs a role", param="messages")
            content = m.get("content")
            if isinstance(content, list):  # OpenAI content parts: keep the text ones
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict)
                                  and p.get("type") == "text")
            norm.append({**m, "content": content or ""})
        try:
            return self.tokenizer.apply_chat_template(norm, tokenize=False,
                                                      chat_template=chat_template or self.chat_template,
                                                      add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message,
                                                      **template_kwargs)
        except Exception as e:  # template errors (e.g. roles it rejects) are the caller's
            raise InvalidRequestError(f"chat template failed: {e}", param="messages") from None

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text. A text too long to ever fit is refused before it is tokenized (which
        takes about 1 s per MB of text)."""
        if len(prompt) > self.max_prompt_chars:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt has "
                f"{len(prompt)} characters, at least {len(prompt) // self.max_token_chars} tokens.",
                param="prompt", code="context_length_exceeded")
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    @property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for (its vocabulary entry is never shorter)."""
        if self._max_token_chars is None:
            self._max_token_chars = max(map(len, self.tokenizer.get_vocab()), default=1)
        return self._max_token_chars

    @property
    def max_prompt_chars(self) -> int:
        # x2: a Unicode normalizer may shorten a text before it is split
        return 2 * self.max_model_len * self.max_token_chars

    def process(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                arrival_time: float | None = None, add_special_tokens: bool = True,
                prompt_token_ids: list[int] | None = None, priority: int = 0,
                prompt_only: bool = False) -> ProcessedRequest:
        """`prompt_token_ids`: the text prompt's ids when the caller tokenized it already. `prompt_only`:
        the caller keeps none of the output (an echo with max_tokens 0, which runs as max_tokens 1 for
        the prompt's logprobs), so the prompt may fill max_model_len, as in vLLM."""
        self.check_priority(priority)
        if isinstance(prompt, str):
            text = prompt
            ids = self.tokenize(prompt, add_special_tokens) if prompt_token_ids is None else prompt_token_ids
        else:
            text, ids = None, list(prompt)
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        max_tokens = self.check_length(len(ids), params.max_tokens, prompt_only)  # first: it bounds the loop below
        if text is None and any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size
                                for t in ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {self.vocab_size})", param="prompt")
        params.check_vocab(self.vocab_size, self.max_logprobs)
        if params.structured_outputs is not None:
            from tokenmill.structured_output.compiler import validate  # xgrammar: only when asked for

            validate(params.structured_outputs.spec())
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children = []
        for i in range(params.n):
            p = CoreSamplingParams.from_params(params.for_child(i) if params.n > 1 else params)
            children.append(EngineCoreRequest(child_id(request_id, i, params.n), ids, p, self.eos_token_ids,
                                              max_tokens, arrival, priority=priority))
        return ProcessedRequest(request_id, text, ids, params, children, arrival)

    def check_priority(self, priority: int) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}", param="priority")
        if priority != 0 and not self.priority_scheduling:
            raise InvalidRequestError(f"priority {priority} needs the priority scheduling policy (the server runs "
                                      f"with --scheduling-policy fcfs)", param="priority")

    def check_length(self, num_prompt: int, max_tokens: int | None, prompt_only: bool = False) -> int:
        """The effective max_tokens; rejects what can never fit the model length. A prompt-only request's
        one token is sampled from the prompt's last position and never fed back: it needs no room."""
        limit = self.max_model_len
        if prompt_only and num_prompt <= limit:
            return 1
        if num_prompt >= limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{num_prompt} tokens, leaving no room for output.", param="prompt", code="context_length_exceeded")
        if max_tokens is None:
            return limit - num_prompt
        if num_prompt + max_tokens > limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} for the "
                f"completion). Please reduce the prompt or max_tokens.", param="max_tokens",
                code="context_length_exceeded")
        return max_tokens
