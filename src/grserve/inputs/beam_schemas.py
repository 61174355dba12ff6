"""Wire types of the retrieval server's OpenAI routes: ``/v1/chat/completions`` and ``/v1/completions`` answered with
SID beams, one catalog item per choice (``server/retrieval/beams.py``; docs/serving-gr-models.md lists every parameter).

Requests are strict and closed like the LLM server's (``openai_schemas.py``): strict types, UTF-8 strings, unknown
fields a 400 naming them. The accepted parameters are what GR clients send:

- ``n``: results returned (choices, best first); at most the beam width;
- the beam width: ``beam_width`` (grserve), or vLLM's ``use_beam_search: true`` with ``best_of`` (both given: they
  must agree); default: the server's ``--beam-width``;
- ``max_tokens`` / ``max_completion_tokens``: at least the tokens of one item (the SID depth), if given;
- ``exclude_items``: catalog item ids never returned; ``include_items`` / ``include_sid_prefix``: the only items
  that may be (as on ``/v1/recommend``);
- think-then-recommend: ``max_think_tokens`` (0: none) and the text stage's ``temperature`` (0: greedy), ``top_p``,
  ``top_k``, ``seed``; beams are exact search and use none of these;
- ``stream`` (+ ``stream_options.include_usage``): the finished beam set as one chunk;
- chat only: ``chat_template_kwargs`` (passed to the model's chat template, e.g. ``{"enable_thinking": false}``);
- any parameter as ``null``, and OpenAI's other parameters at their defaults (``"logprobs": false``,
  ``"frequency_penalty": 0``, ``"response_format": {"type": "text"}``, ...: ``openai_defaults.py``); at another
  value they are a 400 naming them.

An answer choice carries the item's SID text as its content and three extension fields: ``item_id``, ``sid`` (the
codes) and ``cumulative_logprob`` (the summed log-probability of the SID tokens under the server's scoring); asked
(chat ``logprobs: true``, completions ``logprobs: 0``), its ``logprobs`` in OpenAI's shape give each SID token's own
log-probability under that scoring (they sum to ``cumulative_logprob``; no alternatives).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, StrictInt, field_validator, model_validator

from grserve.inputs.openai_defaults import neutral_body
from grserve.inputs.openai_schemas import (
    Bool,
    ChatLogprobs,
    ChatMessage,
    CompletionLogprobs,
    Float,
    Seed,
    StreamOptions,
    Text,
    TokenId,
    Usage,
    unsupported,
)

PosInt = Annotated[int, Strict(), Field(ge=1)]


class BeamRequest(BaseModel):
    """What both routes share: the model, the beams, the thinking stage."""

    model_config = ConfigDict(extra="forbid")
    model: Text
    n: PosInt = 1
    beam_width: PosInt | None = None
    use_beam_search: Bool | None = None  # vLLM's switch: true, or left out (every answer here is a beam search)
    best_of: PosInt | None = None  # vLLM's beam width when use_beam_search
    max_tokens: PosInt | None = None
    exclude_items: list[StrictInt] | None = None
    include_items: list[StrictInt] | None = None  # an allowlist: only these catalog items
    include_sid_prefix: Annotated[list[StrictInt], Field(min_length=1)] | None = None  # only items under this prefix
    exclude_history: Bool = False  # never return an item whose whole SID the prompt writes
    max_think_tokens: Annotated[int, Strict(), Field(ge=0)] = 0
    temperature: Annotated[Float, Field(ge=0.0, le=2.0)] = 0.0
    top_p: Annotated[Float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Strict(), Field(ge=0)] = 0
    seed: Seed | None = None
    stream: Bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None  # accepted, no effect (OpenAI's abuse-monitoring id)
    metadata: dict[Text, Text] | None = None  # accepted, no effect

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data: Any) -> Any:
        """A ``null`` is the parameter left out; OpenAI parameters these routes do not implement are accepted at their
        default and a 400 naming them otherwise (``openai_defaults.py``)."""
        return neutral_body(data, cls.model_fields)

    @model_validator(mode="after")
    def _beam_switch(self) -> "BeamRequest":
        if self.use_beam_search is False:
            raise ValueError("use_beam_search: this server answers every request with a beam search over the "
                             "catalog; leave it out or set it true")
        if self.best_of is not None and self.beam_width is not None and self.best_of != self.beam_width:
            raise ValueError(f"best_of ({self.best_of}) and beam_width ({self.beam_width}) both set the beam width "
                             "and differ")
        return self

    def requested_beam_width(self) -> int | None:
        return self.beam_width if self.beam_width is not None else self.best_of

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class BeamCompletionRequest(BeamRequest):
    prompt: Text | list[TokenId]  # text (rendered as is), or token ids
    logprobs: Annotated[int, Strict(), Field(ge=0)] | None = None  # 0: each SID token's logprob (no alternatives)

    @model_validator(mode="after")
    def _logprobs(self) -> "BeamCompletionRequest":
        if self.logprobs:
            raise unsupported("logprobs", "a beam's SID tokens come with their own log-probabilities only "
                                          "(logprobs: 0); alternatives are not returned")
        return self

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | list[int]) -> str | list[int]:
        if not v:  # a field check, so the error names ``prompt``
            raise ValueError("prompt must not be empty")
        return v


_TEMPLATE_CALL_ARGS = frozenset({"messages", "conversation", "tools", "documents", "chat_template", "tokenize",
                                 "add_generation_prompt", "continue_final_message", "return_tensors", "return_dict",
                                 "return_assistant_tokens_mask", "padding", "truncation", "max_length",
                                 "tokenizer_kwargs", "processor_kwargs"})


class BeamChatRequest(BeamRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: PosInt | None = None
    chat_template_kwargs: dict[Text, Any] | None = None
    logprobs: Bool = False  # true: each SID token's log-probability in the choice's logprobs.content
    top_logprobs: Annotated[int, Strict(), Field(ge=0)] | None = None  # only 0 (no alternatives)

    def wants_logprobs(self) -> bool:
        return self.logprobs

    @model_validator(mode="after")
    def _template_kwargs(self) -> "BeamChatRequest":
        if self.top_logprobs:
            raise unsupported("top_logprobs", "a beam's SID tokens come with their own log-probabilities only; "
                                              "alternatives are not returned (top_logprobs: 0)")
        for key in self.chat_template_kwargs or {}:
            if not key.isidentifier() or key in _TEMPLATE_CALL_ARGS:
                raise ValueError(f"chat_template_kwargs: {key!r} is not a template variable this server passes on")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# ---- answers ---------------------------------------------------------------------------------------------------
class Thinking(BaseModel):
    """The text the model wrote before its first SID token (returned once per answer, not per choice)."""

    text: str
    tokens: int  # tokens written, the closing sid_begin included
    sid_begin_forced: bool  # max_think_tokens was reached and sid_begin appended


class _Item(BaseModel):
    index: int
    finish_reason: Literal["stop"] = "stop"
    item_id: int
    sid: list[int]
    cumulative_logprob: float


class BeamMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class BeamChatChoice(_Item):
    message: BeamMessage
    logprobs: ChatLogprobs | None = None  # logprobs: true — one entry per SID token


class BeamCompletionChoice(_Item):
    text: str
    logprobs: CompletionLogprobs | None = None  # logprobs: 0 — one entry per SID token


class _BeamAnswer(BaseModel):
    id: str
    created: int
    model: str
    usage: Usage | None = None
    thinking: Thinking | None = None
    beam_width: int
    catalog_version: int


class BeamChatResponse(_BeamAnswer):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[BeamChatChoice]


class BeamCompletionResponse(_BeamAnswer):
    object: Literal["text_completion"] = "text_completion"
    choices: list[BeamCompletionChoice]


class BeamChatDelta(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class BeamChatChunkChoice(_Item):
    delta: BeamChatDelta
    logprobs: ChatLogprobs | None = None


class BeamChatChunk(_BeamAnswer):
    """The one streamed chunk of a chat answer: every choice, finished (``usage`` in a chunk of its own)."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[BeamChatChunkChoice]


class BeamCompletionChunk(_BeamAnswer):
    object: Literal["text_completion"] = "text_completion"
    choices: list[BeamCompletionChoice]
