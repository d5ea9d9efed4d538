"""OpenAI API request bodies (pydantic), with vLLM's extra sampling parameters, and their
conversion to SamplingParams. Unknown fields are ignored, as OpenAI's API does."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, model_validator

from tokenmill.entrypoints.openai.openapi import (
    FIM_SUFFIX,
    LOGPROBS,
    OUTPUT_TOKENS,
    PRIORITY,
    PROMPT_CHARS,
    SERVED_MODEL,
    TOKEN_ID,
    TOKEN_KEY,
    TOKEN_LIST,
)
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import RequestOutputKind, SamplingParams
from tokenmill.structured_output import StructuredOutputsParams

MAX_CHOICES = 128  # n x prompts of one request


def _integral(v):
    """JSON Schema's integer includes 3.0; nothing else that is not an int becomes one (no bools, no strings)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


Int = Annotated[int, BeforeValidator(_integral)]
_SEED = dict(ge=-(2**63), le=2**63)  # what torch takes; exact as a JSON Schema float
NonEmptyStr = Annotated[str, Field(min_length=1)]
PromptText = Annotated[str, Field(json_schema_extra={PROMPT_CHARS: True})]
NonEmptyPrompt = Annotated[str, Field(min_length=1, json_schema_extra={PROMPT_CHARS: True})]
_BIAS = {"type": "number", "minimum": -100, "maximum": 100}
LogitBias = Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]+$")], Annotated[float, Field(ge=-100, le=100)]],
                      WithJsonSchema({"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
                                      "additionalProperties": _BIAS, TOKEN_KEY: True})]
TokenId = Annotated[Int, Field(ge=0, json_schema_extra={TOKEN_ID: True})]
TokenIds = Annotated[list[TokenId], Field(min_length=1, json_schema_extra={TOKEN_LIST: True})]


def _implies(field: str, when: dict, other: str, must_be) -> dict:
    """JSON Schema for "when `field` matches `when`, `other` must equal `must_be`"."""
    return {"if": {"properties": {field: when}, "required": [field]},
            "then": {"properties": {other: {"const": must_be}}, "required": [other]}}


_STREAM_OPTIONS_NEED_STREAM = _implies("stream_options", {"type": "object"}, "stream", True)
_CONTINUE_NEEDS_NO_GENERATION_PROMPT = _implies("continue_final_message", {"const": True},
                                                "add_generation_prompt", False)


class OpenAIModel(BaseModel):
    # Unknown fields are ignored, as OpenAI does. Types are strict, as the schema says (no "5" for 5,
    # no 0 for false), and floats finite (1e400 parses as inf).
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="vLLM's: with include_usage, every chunk carries "
                                         "the usage so far.")


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

    model: str | None = Field(None, description="The served model's name (or omitted).",
                              json_schema_extra={SERVED_MODEL: True})
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    n: Int = Field(1, ge=1, le=MAX_CHOICES, description=f"Samples per prompt; n x prompts <= {MAX_CHOICES}.")
    stream: bool = False
    stream_options: StreamOptions | None = Field(None, description="Only with stream: true.")
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    seed: Int | None = Field(None, **_SEED)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: LogitBias | None = Field(None, description="Token id (a decimal string) -> bias added to its logit.")
    user: str | None = None
    # vLLM's extra parameters
    top_k: Int | None = Field(None, ge=-1, description="0 or -1: all tokens.")
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = Field(False, description="Not with a structured output (its grammar decides the end).")
    min_tokens: Int = Field(0, ge=0, description="At most max_tokens; not with a structured output.")
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Int = Field(0, ge=-(2**31), le=2**31 - 1, json_schema_extra={PRIORITY: True},
                          description="Lower is served first (--scheduling-policy priority; else it must be 0).")
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs (and its older guided_*)
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: NonEmptyStr | None = None
    guided_choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    guided_grammar: NonEmptyStr | None = None

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
        from tokenmill.structured_output.compiler import validate  # xgrammar (and transformers): when asked for

        param, params = found[0]
        validate(params.spec(), param)
        return params

    def usage_every_chunk(self) -> bool:
        """vLLM's continuous_usage_stats (with include_usage): the usage so far on every chunk."""
        o = self.stream_options
        return o is not None and o.include_usage and o.continuous_usage_stats

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
    model_config = ConfigDict(json_schema_extra={"allOf": [
        _STREAM_OPTIONS_NEED_STREAM, _implies("max_tokens", {"const": 0}, "echo", True),
        {"if": {"properties": {"suffix": {"type": "string", "minLength": 1}}, "required": ["suffix"]},
         "then": {"properties": {"echo": {"const": False}}}}]})
    prompt: NonEmptyPrompt | Annotated[list[NonEmptyPrompt], Field(min_length=1, max_length=MAX_CHOICES)] | TokenIds | \
        Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_CHOICES)] = Field(
            description="Text, a list of texts, token ids, or a list of token-id lists. Each prompt plus max_tokens "
                        "must fit the model's context length (400 otherwise).")
    max_tokens: Int | None = Field(None, ge=0, description="Default 16; 0 only with echo (prompt logprobs only).",
                                   json_schema_extra={OUTPUT_TOKENS: True})
    echo: bool = False
    logprobs: Int | None = Field(None, ge=0, json_schema_extra={LOGPROBS: True})
    best_of: Int | None = Field(None, ge=1, description="Only equal to n (no server-side ranking).")
    suffix: str | None = Field(None, json_schema_extra={FIM_SUFFIX: True},
                               description="Fill in the middle: the text after the completion; the prompt is the "
                                           "text before it. Needs a model with FIM tokens (400 otherwise); not with "
                                           "echo.")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result's call


# apply_chat_template's own arguments: a template variable cannot take their place
RESERVED_TEMPLATE_KWARGS = ("conversation", "messages", "tools", "documents", "chat_template",
                            "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                            "truncation", "max_length", "return_tensors", "return_dict",
                            "return_assistant_tokens_mask", "tokenizer_kwargs")


def _no_reserved_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Checked whether or not a template renders (/tokenize of a prompt too): the schema says so."""
    reserved = sorted(set(kwargs) & set(RESERVED_TEMPLATE_KWARGS))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
    return kwargs


TemplateKwargs = Annotated[dict[str, Any], AfterValidator(_no_reserved_kwargs), Field(json_schema_extra={
    "propertyNames": {"not": {"enum": list(RESERVED_TEMPLATE_KWARGS)}}})]


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra={"allOf": [
        _STREAM_OPTIONS_NEED_STREAM, _implies("top_logprobs", {"type": "integer"}, "logprobs", True),
        _CONTINUE_NEEDS_NO_GENERATION_PROMPT]})
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Int | None = Field(None, ge=1, description="Deprecated name of max_completion_tokens.",
                                   json_schema_extra={OUTPUT_TOKENS: True})
    max_completion_tokens: Int | None = Field(None, ge=1, json_schema_extra={OUTPUT_TOKENS: True})
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0, description="Only with logprobs: true.",
                                     json_schema_extra={LOGPROBS: True})
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(False, description="Leave the last message open for the model to "
                                         "continue (an assistant prefill); needs add_generation_prompt false.")
    chat_template_kwargs: TemplateKwargs | None = None


class TokenizeRequest(OpenAIModel):
    """Exactly one of prompt or messages."""

    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}}, "required": ["prompt"]},
        {"properties": {"messages": {"type": "array"}, "prompt": {"type": "null"}}, "required": ["messages"]}],
        "allOf": [_CONTINUE_NEEDS_NO_GENERATION_PROMPT]})

    model: str | None = Field(None, json_schema_extra={SERVED_MODEL: True})
    prompt: PromptText | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = Field(None, description="With messages: rendered as a chat request would.")
    chat_template_kwargs: TemplateKwargs | None = None

    @model_validator(mode="after")
    def _continue_needs_no_generation_prompt(self) -> TokenizeRequest:
        """The schema's rule holds for a prompt too, where no template renders (render_chat checks messages)."""
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self


class DetokenizeRequest(OpenAIModel):
    model: str | None = Field(None, json_schema_extra={SERVED_MODEL: True})
    tokens: list[TokenId] = Field(default_factory=list)
