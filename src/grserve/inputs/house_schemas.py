"""Wire types of the house HTTP API (pydantic v2): retrieval (``/v1/recommend``, ``/v1/catalog``) and ranking
(``/v1/rank``, ``/v1/users``, ``/v1/items``). The OpenAI API's types are in ``openai_schemas.py``.

Numbers are strict: ``"5"``, ``5.0`` and ``true`` are rejected where an integer is expected, so a client bug
shows up as a 422 naming the field instead of being silently coerced. Unknown top-level fields are rejected
too (a typo such as ``history_item`` would otherwise look like a missing history). Range checks that pydantic
does (``ge=1``, ``min_length=1``) answer 400, like every other bad value (``server/http/errors.py``).
"""

from __future__ import annotations

import unicodedata
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator
from pydantic_core import PydanticCustomError

from grserve.inputs.openai_schemas import ChatMessage

HISTORY_FIELDS = ("history_items", "history_sids", "history_tokens", "prompt", "messages")
UNPRINTABLE = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})  # control, format, surrogate, line/paragraph separators

NonEmptyInts = Annotated[list[StrictInt], Field(min_length=1)]
Truncate = Literal["left", "none"]
Source = Literal["model", "popularity"]


def _printable(value: str) -> str:
    """A client's id is echoed in answers and may be logged: no character that could break or forge a line."""
    for i, c in enumerate(value):
        if unicodedata.category(c) in UNPRINTABLE:
            raise ValueError(f"must not contain control characters (U+{ord(c):04X} at position {i})")
    return value


# the client's own id of a request: echoed in the answer, never the engine's key (the server makes that one)
RequestId = Annotated[StrictStr, Field(min_length=1, max_length=128), AfterValidator(_printable)]


class RecommendRequest(BaseModel):
    """A user's history, in exactly one of five forms, and the search knobs.

    - ``history_items``: catalog item ids, oldest first; each is mapped to its SID (wrapped in ``sid_begin`` /
      ``sid_end`` where the layout has them).
    - ``history_sids``: SIDs, one ``[c_0, ..., c_{depth-1}]`` list per item (code ``c_l`` in ``[0, codebook_size_l)``).
    - ``history_tokens``: raw prompt token ids, each in ``[0, vocab_size)``.
    - ``prompt``: text with the items written as SID token text, encoded with the model's tokenizer.
    - ``messages``: a chat (OpenAI's messages), rendered with the model's chat template.

    ``max_think_tokens`` > 0: the model first writes free text (greedy) until ``sid_begin``
    (think-then-recommend, ``engine/think.py``); the text comes back in ``thinking``.

    ``exclude_items`` are never returned, nor with ``exclude_history`` the items the history names (its item ids;
    every item of its SIDs; the items whose whole SID its tokens or prompt write); with ``include_items`` and/or ``include_sid_prefix`` only the items they
    allow are (both inside the beam search, equal to a search over the catalog restricted to them).
    An empty history (``history_*``) is a new user (cold start): where it lays out to no prompt token, it is answered
    from the popularity order (``catalog/popularity.py``).
    ``truncate``: a ``history_*`` longer than the server's ``--max-prompt-tokens`` keeps its newest entries that fit
    (``"left"``) or is refused with 413 (``"none"``); unset: the server's ``--truncate`` (default ``"left"``).
    """

    model_config = ConfigDict(extra="forbid")

    history_items: list[StrictInt] | None = None
    history_sids: list[list[StrictInt]] | None = None
    history_tokens: list[StrictInt] | None = None
    prompt: Annotated[StrictStr, Field(min_length=1)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    max_think_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    beam_width: Annotated[StrictInt, Field(ge=1)] | None = None  # None → the server's SearchConfig.beam_width
    top_n: Annotated[StrictInt, Field(ge=1)] = 10
    exclude_items: list[StrictInt] | None = None  # catalog item ids never returned (masked inside the search)
    include_items: list[StrictInt] | None = None  # an allowlist: only these catalog items (masked alike)
    include_sid_prefix: Annotated[list[StrictInt], Field(min_length=1)] | None = None  # only items under this prefix
    exclude_history: StrictBool = False  # never return an item the history names (catalog/history.py)
    truncate: Truncate | None = None  # None → the server's ServerConfig.truncate
    request_id: RequestId | None = None

    @model_validator(mode="after")
    def _exactly_one_history(self) -> "RecommendRequest":
        given = [name for name in HISTORY_FIELDS if getattr(self, name) is not None]
        if not given:
            raise PydanticCustomError(
                "history_missing", "exactly one of history_items, history_sids, history_tokens, prompt, messages "
                                   "is required")
        if len(given) > 1:
            raise PydanticCustomError(
                "history_ambiguous",
                "exactly one of history_items, history_sids, history_tokens, prompt, messages may be given, got "
                "{given}", {"given": ", ".join(given)})
        return self

    @property
    def history_kind(self) -> str:
        return next(name for name in HISTORY_FIELDS if getattr(self, name) is not None)


class ItemOut(BaseModel):
    item_id: int
    sid: list[int]
    score: float  # source "model": summed log-probability of the SID tokens; "popularity": log of the item's share


class Timing(BaseModel):
    queue_ms: float  # arrival at the engine → batch start
    compute_ms: float  # batch start → result
    total_ms: float  # request received by the HTTP handler → response built


class PromptUsage(BaseModel):
    prompt_tokens: int  # tokens of the prompt the history (or chat) laid out to
    cached_tokens: int = 0  # of them, tokens whose K/V came from the prefix cache (--prefix-cache-tokens), not computed


class RecommendResponse(BaseModel):
    request_id: str  # the client's request_id, else the server's id of the request
    items: list[ItemOut]  # best first
    source: Source = "model"  # "popularity": the history laid out to no prompt token (cold start)
    history_dropped: int = 0  # oldest history entries (items, SIDs or tokens, as given) cut by truncate "left"
    thinking: str | None = None  # max_think_tokens > 0: the text the model wrote before its first SID token
    beam_width: int
    catalog_version: int
    timing: Timing
    batch_size: int  # requests in the engine batch that served this one
    usage: PromptUsage  # the prompt's tokens, and how many were reused from the prefix cache


class CatalogReloadRequest(BaseModel):
    """A catalog file *name* in the server's ``--catalog-dir`` (never a path; ``server/retrieval/catalog_reload.py``)."""

    model_config = ConfigDict(extra="forbid")

    name: Annotated[StrictStr, Field(min_length=1, max_length=255)]


class CatalogInfo(BaseModel):
    num_items: int
    version: int
    depth: int
    codebook_sizes: list[int]


class CatalogReloadResponse(BaseModel):
    catalog: CatalogInfo
    previous_version: int


class ErrorDetail(BaseModel):
    message: str
    field: str | None = None  # e.g. "history_sids[3][1]"; None when the error is not about one field
    type: str  # machine-readable kind, e.g. "unknown_items", "out_of_range", "invalid_json"


# ---- ranking (BAT) ------------------------------------------------------------------------------------------
class RankRequest(BaseModel):
    """A user (``user_id`` of a registered user, or raw ``user_tokens``) and candidates (registered
    ``candidates`` item ids, or raw ``candidate_tokens`` lists whose last token is the identifier token)."""

    model_config = ConfigDict(extra="forbid")

    user_id: StrictInt | None = None
    user_tokens: list[StrictInt] | None = None
    candidates: list[StrictInt] | None = None
    candidate_tokens: list[list[StrictInt]] | None = None
    top_k: Annotated[StrictInt, Field(ge=1)] = 10
    request_id: RequestId | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> "RankRequest":
        for a, b, what in (("user_id", "user_tokens", "user"), ("candidates", "candidate_tokens", "candidates")):
            given = [n for n in (a, b) if getattr(self, n) is not None]
            if len(given) != 1:
                raise PydanticCustomError(
                    f"{what}_missing" if not given else f"{what}_ambiguous",
                    "exactly one of {a}, {b} is required" if not given else "exactly one of {a}, {b} may be given",
                    {"a": a, "b": b})
        return self


class RankedItem(BaseModel):
    index: int  # position in the request's candidate list
    item_id: int | None  # None for raw candidates
    score: float  # softmax probability over the request's candidates (sums to 1 over them)
    logprob: float  # log-probability of the identifier token over the whole vocabulary: comparable across requests


class RankResponse(BaseModel):
    request_id: str  # the client's request_id, else the server's id of the request
    items: list[RankedItem]  # best first
    layout: str  # "user_prefix" | "item_prefix"
    total_tokens: int
    computed_tokens: int
    cached_tokens: int
    user_cache_hit: bool
    batch_size: int
    timing: Timing


class UserIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: StrictInt
    tokens: Annotated[list[StrictInt], Field(min_length=1)]


class ItemIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    item_id: StrictInt
    tokens: Annotated[list[StrictInt], Field(min_length=1)]  # the last token is the identifier token


class UsersRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    users: Annotated[list[UserIn], Field(min_length=1)]


class ItemsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    items: Annotated[list[ItemIn], Field(min_length=1)]


class RegisterResponse(BaseModel):
    registered: int
    replaced: int
    total: int
