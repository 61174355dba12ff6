"""Wire types of the OpenAI-compatible API (pydantic v2): request bodies and responses of ``/v1/completions``,
``/v1/chat/completions`` (whole or as SSE chunks), ``/v1/models``, ``/tokenize``, ``/detokenize``, ``/version``.

Requests are strict and closed:
- **types are strict**: ``max_tokens: "16"`` or ``true`` is a 400, not 16 or 1; a float field takes an int but
  not a bool or a string; NaN/Infinity are refused; ``seed`` must fit 64 bits (``[-2**63, 2**64)``);
- **every string must be valid UTF-8** (a lone surrogate ``"\\ud800"`` is a 400 naming the field);
- **unknown fields are a 400 naming them** (``extra="forbid"``), and fields OpenAI defines that this server does
  not implement are a 400 naming the parameter (``unsupported()`` raises): nothing is silently ignored. Accepted
  no-ops: ``user`` / ``metadata`` (OpenAI's own bookkeeping fields), any parameter sent as ``null`` (its default
  applies) and OpenAI parameters sent at their default (``openai_defaults.py``).

Structured output (``engine/structured.py``): ``response_format`` ``{"type": "json_object"}`` or ``{"type":
"json_schema", "json_schema": {"name", "schema", "strict"}}`` (chat and completions, as vLLM), or vLLM's
``structured_outputs`` ``{"json" | "regex" | "choice" | "grammar" | "json_object": ...}`` (and its older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``): at most one of them; a schema, regex or
grammar that xgrammar cannot compile is a 400 naming the field (``structured_spec``).

Fields that are ``None`` in a streamed delta or a chunk's ``usage`` are left out of the JSON, as OpenAI does.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, AllowInfNan, BaseModel, ConfigDict, Field, PrivateAttr, Strict, \
    field_validator, model_validator

from grserve.engine.structured import GrammarError, StructuredSpec, check
from grserve.inputs.refusal import ApiError
from grserve.inputs.openai_tools import ToolPlan, tool_plan
from grserve.inputs.openai_defaults import neutral_body

FinishReason = Literal["stop", "length", "tool_calls"]
MAX_TOKEN_ID_DIGITS = 19  # a token id fits int64
INT64_MIN, UINT64_END = -(2 ** 63), 2 ** 64


def _absent(value: Any) -> bool:
    return value is None


def _utf8(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid UTF-8 text (a lone surrogate at position {exc.start})") from None
    return s


Text = Annotated[str, Strict(), AfterValidator(_utf8)]
Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]
Float = Annotated[float, Strict(), AllowInfNan(False)]  # an int is accepted, a bool or a string is not
Seed = Annotated[int, Strict(), Field(ge=INT64_MIN, lt=UINT64_END)]
TokenId = Annotated[int, Strict(), Field(ge=0)]


def unsupported(param: str, message: str) -> ApiError:
    return ApiError(400, f"'{param}' is not supported by this server: {message}", param, "unsupported_parameter")


# ---- requests ------------------------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    """OpenAI's ``include_usage`` (a last chunk with the usage) and vLLM's ``continuous_usage_stats`` (with it,
    the usage so far in every chunk; guidellm sends it)."""

    model_config = ConfigDict(extra="forbid")
    include_usage: Bool = False
    continuous_usage_stats: Bool = False


class SamplingRequest(BaseModel):
    """What completions and chat completions share: the model, the sampling knobs and vLLM's extras."""

    model_config = ConfigDict(extra="forbid")
    model: Text
    max_tokens: Annotated[int, Strict(), Field(ge=1)] | None = None
    temperature: Annotated[Float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[Float, Field(gt=0.0, le=1.0)] = 1.0
    n: Annotated[int, Strict(), Field(ge=1)] = 1
    stream: Bool = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    seed: Seed | None = None
    presence_penalty: Annotated[Float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[Float, Field(ge=-2.0, le=2.0)] = 0.0
    logit_bias: dict[Text, Annotated[Float, Field(ge=-100.0, le=100.0)]] | None = None
    user: Text | None = None  # accepted, no effect (OpenAI's abuse-monitoring id)
    metadata: dict[Text, Text] | None = None  # accepted, no effect
    # vLLM's extras
    top_k: Annotated[int, Strict(), Field(ge=-1)] | None = None  # -1 / 0 / None: off
    min_p: Annotated[Float, Field(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[Float, Field(gt=0.0, le=10.0)] = 1.0
    min_tokens: Annotated[int, Strict(), Field(ge=0)] = 0
    ignore_eos: Bool = False
    stop_token_ids: list[TokenId] | None = None
    # grserve's extra: co-location class (docs/llm.md "Online/offline co-location"); online work preempts offline
    priority: Literal["online", "offline"] = "online"
    # structured output (OpenAI's response_format; vLLM's structured_outputs and guided_* extras)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Text | dict[str, Any] | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    _spec: StructuredSpec | None = PrivateAttr(default=None)
    _spec_field: str | None = PrivateAttr(default=None)
    _spec_checked: bool = PrivateAttr(default=False)

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data: Any) -> Any:
        """A ``null`` is the parameter left out; an OpenAI parameter not implemented here is accepted at its default
        (``openai_defaults.py``)."""
        return neutral_body(data, cls.model_fields)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list):
            if len(v) > 4:
                raise ValueError("at most 4 stop sequences")
            if any(not s for s in v):
                raise ValueError("stop sequences must be non-empty")
        elif v == "":
            raise ValueError("stop sequence must be non-empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for k in v or {}:
            if not k.isdecimal() or not k.isascii() or len(k) > MAX_TOKEN_ID_DIGITS:  # int() refuses > 4300 digits
                shown = k if len(k) <= MAX_TOKEN_ID_DIGITS else k[:MAX_TOKEN_ID_DIGITS] + "..."
                raise ValueError(f"key {shown!r} is not a token id")
        return v

    @model_validator(mode="after")
    def _structured(self) -> "SamplingRequest":
        self.structured_spec()  # a 400 now, naming the field, for what cannot compile
        return self

    def structured_spec(self) -> StructuredSpec | None:
        """The structured-output spec the request asks for (None: free text); ``ApiError`` 400 naming the field
        for a malformed one or one xgrammar cannot compile. Checked once, cached."""
        if self._spec_checked:
            return self._spec
        found = [(f, sp) for f, sp in _structured_fields(self) if sp is not None]
        if len(found) > 1:
            raise ApiError(400, f"give at most one structured-output field, got {', '.join(f for f, _ in found)}",
                           found[1][0], "invalid_value")
        spec = found[0][1] if found else None
        if spec is not None and self.min_tokens:  # it masks EOS where the grammar may allow only EOS
            raise ApiError(400, "min_tokens cannot be combined with structured output (the grammar decides where "
                                "the answer ends)", "min_tokens", "invalid_value")
        if spec is not None:
            try:
                check(spec)
            except GrammarError as exc:
                raise ApiError(400, f"{found[0][0]}: cannot be compiled: {exc}", found[0][0], "invalid_value") \
                    from None
        self._spec, self._spec_field, self._spec_checked = spec, found[0][0] if found else None, True
        return spec

    @property
    def structured_field(self) -> str | None:
        """The field that asks for structured output (``response_format``, ``structured_outputs``, a
        ``guided_*``), as a 400 names it; None for free text."""
        self.structured_spec()
        return self._spec_field

    def stops(self) -> tuple[str, ...]:
        return () if self.stop is None else ((self.stop,) if isinstance(self.stop, str) else tuple(self.stop))

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def logprobs_k(self) -> int | None:
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every streamed chunk: vLLM's ``continuous_usage_stats``, which needs ``include_usage``."""
        return bool(self.include_usage and self.stream_options.continuous_usage_stats)  # type: ignore[union-attr]


def _bad(field: str, message: str) -> ApiError:
    return ApiError(400, f"{field}: {message}", field, "invalid_value")


def _schema_text(field: str, schema: Any) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise _bad(field, "not valid JSON") from None
    if not isinstance(schema, (dict, bool)):
        raise _bad(field, "a JSON schema must be an object")
    return json.dumps(schema)


def _response_format(rf: dict[str, Any]) -> tuple[str, StructuredSpec | None]:
    kind = rf.get("type")
    if kind == "text":
        if set(rf) != {"type"}:
            raise _bad("response_format", "{'type': 'text'} takes no other fields")
        return "response_format", None
    if kind == "json_object":
        if set(rf) != {"type"}:
            raise _bad("response_format", "{'type': 'json_object'} takes no other fields")
        return "response_format", StructuredSpec("json_object")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if set(rf) != {"type", "json_schema"} or not isinstance(js, dict):
            raise _bad("response_format.json_schema", "required: an object with 'name' and 'schema'")
        extra = set(js) - {"name", "schema", "strict", "description"}
        if extra:
            raise _bad(f"response_format.json_schema.{sorted(extra)[0]}", "unknown field")
        if not isinstance(js.get("name"), str) or not isinstance(js.get("strict", False), (bool, type(None))):
            raise _bad("response_format.json_schema", "'name' must be a string and 'strict' a boolean")
        if "schema" not in js:
            raise _bad("response_format.json_schema.schema", "required")
        field = "response_format.json_schema.schema"
        return field, StructuredSpec("json_schema", _schema_text(field, js["schema"]))
    raise _bad("response_format.type", f"must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def _structured_fields(body: SamplingRequest) -> list[tuple[str, StructuredSpec | None]]:
    out: list[tuple[str, StructuredSpec | None]] = []
    if body.response_format is not None:
        out.append(_response_format(body.response_format))
    so = body.structured_outputs
    if so is not None:
        given = {k: v for k, v in so.items() if v is not None and v is not False}
        unknown = set(given) - {"json", "regex", "choice", "grammar", "json_object"}
        if unknown:
            raise ApiError(400, f"structured_outputs.{sorted(unknown)[0]} is not supported by this server (json, "
                                "regex, choice, grammar, json_object are)", f"structured_outputs.{sorted(unknown)[0]}",
                           "unsupported_parameter")
        if len(given) > 1:
            raise _bad("structured_outputs", f"give one of json, regex, choice, grammar, json_object; got "
                                             f"{', '.join(sorted(given))}")
        for k, v in given.items():
            out.append(_structured_value(f"structured_outputs.{k}", k, v))
    for k in ("json", "regex", "choice", "grammar"):
        v = getattr(body, f"guided_{k}")
        if v is not None:
            out.append(_structured_value(f"guided_{k}", k, v))
    return out


def _structured_value(field: str, kind: str, v: Any) -> tuple[str, StructuredSpec]:
    if kind == "json":
        return field, StructuredSpec("json_schema", _schema_text(field, v))
    if kind == "json_object":
        if v is not True:
            raise _bad(field, "must be true")
        return field, StructuredSpec("json_object")
    if kind == "choice":
        if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
            raise _bad(field, "must be a non-empty list of non-empty strings")
        for c in v:
            _text(field, c)
        return field, StructuredSpec("choice", json.dumps(v))
    if not isinstance(v, str) or not v:
        raise _bad(field, "must be a non-empty string")
    return field, StructuredSpec(kind, _text(field, v))


def _text(field: str, v: str) -> str:
    try:
        return _utf8(v)
    except ValueError as exc:
        raise _bad(field, str(exc)) from None


class CompletionRequest(SamplingRequest):
    prompt: Text | list[Text] | list[TokenId]  # text, a one-element list of text, or token ids
    echo: Bool = False
    logprobs: Annotated[int, Strict(), Field(ge=0)] | None = None
    best_of: Annotated[int, Strict(), Field(ge=1)] | None = None
    suffix: Text | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | list[str] | list[int]) -> str | list[str] | list[int]:
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if isinstance(v[0], str) and len(v) != 1:
                raise ValueError("only one prompt per request is supported")
        elif v == "":
            raise ValueError("prompt must not be empty")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> "CompletionRequest":
        if self.suffix is not None:
            raise unsupported("suffix", "insertion (text after the completion) is not implemented")
        if self.best_of is not None and self.best_of != self.n:
            raise unsupported("best_of", "best_of must equal n (choosing the best of more samples is not "
                                         "implemented)")
        if self.echo and self.logprobs is not None:
            raise unsupported("echo", "echo with logprobs needs the prompt's log-probabilities, which are not "
                                      "computed")
        return self

    def logprobs_k(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: Text


class OtherPart(BaseModel):
    """A content part OpenAI defines that this server does not implement (rejected with a 400)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image_url", "input_audio", "file", "refusal"]


ContentPart = Annotated[TextPart | OtherPart, Field(discriminator="type")]


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Text
    arguments: Text


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Text | None = None

    @model_validator(mode="after")
    def _shape(self) -> "ChatMessage":
        for part in self.content if isinstance(self.content, list) else []:
            if isinstance(part, OtherPart):
                raise ValueError(f"'{part.type}' content parts are not supported (text only)")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only for an assistant message with tool_calls)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id")
        return self

    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template sees it (text parts joined into one string)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Strict(), Field(ge=1)] | None = None
    logprobs: Bool = False
    top_logprobs: Annotated[int, Strict(), Field(ge=0)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Text | dict[str, Any] | None = None
    parallel_tool_calls: Bool | None = None
    functions: Any = None
    function_call: Any = None
    _tools: ToolPlan | None = PrivateAttr(default=None)

    @property
    def tool_plan(self) -> ToolPlan | None:
        """The validated tools and tool choice (``openai_tools.py``); None without tools."""
        return self._tools

    @model_validator(mode="after")
    def _unsupported(self) -> "ChatCompletionRequest":
        if self.functions is not None or self.function_call is not None:
            raise unsupported("functions" if self.functions is not None else "function_call",
                              "function calling is not implemented")
        self._tools = tool_plan(self.tools, self.tool_choice)  # 400 naming the field for a malformed one
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "'top_logprobs' requires 'logprobs': true", "top_logprobs", "invalid_value")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize``: a prompt, or chat messages rendered by the chat template."""

    model_config = ConfigDict(extra="forbid")
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: Bool | None = None  # default: True for a prompt, False for messages (in the template)
    add_generation_prompt: Bool = True

    @model_validator(mode="after")
    def _one(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Text | None = None
    tokens: list[TokenId]


# ---- responses -----------------------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (not computed)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None


class _Answer(BaseModel):
    """What every answer and chunk carries: the request's id, when it was answered (Unix seconds), the served
    model."""

    id: str
    created: int
    model: str


class CompletionResponse(_Answer):
    """A whole completion, or (``usage`` absent, ``choices`` of one delta) one streamed chunk."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = Field(default=None, exclude_if=_absent)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=_absent)


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletionResponse(_Answer):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ToolCallDelta(BaseModel):
    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = Field(default=None, exclude_if=_absent)
    content: str | None = Field(default=None, exclude_if=_absent)
    tool_calls: list[ToolCallDelta] | None = Field(default=None, exclude_if=_absent)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = Field(default=None, exclude_if=_absent)
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(_Answer):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(default=None, exclude_if=_absent)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "grserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


def usage(n_prompt: int, n_out: int, cached: int = 0) -> Usage:
    """OpenAI usage; ``cached``: prompt tokens served from the prefix cache (``prompt_tokens_details``)."""
    return Usage(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
