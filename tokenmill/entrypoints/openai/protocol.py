"""OpenAI API request bodies (pydantic), with vLLM's extra sampling parameters, and their
conversion to SamplingParams. Unknown fields are ignored, as OpenAI's API does."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import RequestOutputKind, SamplingParams
from tokenmill.structured_output import StructuredOutputsParams
from tokenmill.structured_output.compiler import validate


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced (no extra properties unless it allows them)


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(OpenAIModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra parameters
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0  # lower is served first (--scheduling-policy priority)
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs (and its older guided_*)
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured(self) -> StructuredOutputsParams | None:
        """The one structured-output constraint the request asks for, if any."""
        found: list[tuple[str, StructuredOutputsParams]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise InvalidRequestError("response_format json_schema needs json_schema.schema",
                                          param="response_format")
            found.append(("response_format", StructuredOutputsParams(json=rf.json_schema.schema_)))
        if self.structured_outputs is not None:
            found.append(("structured_outputs", StructuredOutputsParams.from_dict(self.structured_outputs)))
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                found.append((f"guided_{name}", StructuredOutputsParams(**{name: value})))
        if len(found) > 1:
            raise InvalidRequestError(f"{found[0][0]} and {found[1][0]} cannot be combined", param=found[1][0])
        if not found:
            return None
        param, params = found[0]
        validate(params.spec(), param)
        return params

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
                        default_max_tokens: int | None,
                        structured: StructuredOutputsParams | None = None) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options")
        bias = None
        if self.logit_bias:
            try:
                bias = {int(k): v for k, v in self.logit_bias.items()}
            except ValueError:
                raise InvalidRequestError("logit_bias keys must be token ids", param="logit_bias") from None
        return SamplingParams(
            n=self.n, max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=bias, seed=self.seed, min_tokens=self.min_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids, include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=structured,
        )


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        if all(isinstance(x, str) for x in p):
            return list(p)
        if all(isinstance(x, list) for x in p):
            return [list(x) for x in p]
        raise InvalidRequestError("prompt must be a string, a list of strings, or token ids", param="prompt")


class ChatMessage(OpenAIModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result's call


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int] = Field(default_factory=list)


def error_body(message: str, err_type: str, code: int | str | None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}
