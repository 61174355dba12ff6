"""Wire types of the HTTP API (pydantic v2).

Numbers are strict: ``"5"``, ``5.0`` and ``true`` are rejected where an integer is expected, so a client bug
shows up as a 422 naming the field instead of being silently coerced. Unknown top-level fields are rejected
too (a typo such as ``history_item`` would otherwise look like a missing history).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator
from pydantic_core import PydanticCustomError

HISTORY_FIELDS = ("history_items", "history_sids", "history_tokens")

NonEmptyInts = Annotated[list[StrictInt], Field(min_length=1)]


class RecommendRequest(BaseModel):
    """A user's history, in exactly one of three forms, and the search knobs.

    - ``history_items``: catalog item ids, oldest first; each is mapped to its SID.
    - ``history_sids``: SIDs, one ``[c_0, ..., c_{depth-1}]`` list per item (code ``c_l`` in ``[0, codebook_size_l)``).
    - ``history_tokens``: raw prompt token ids, each in ``[0, vocab_size)``.
    """

    model_config = ConfigDict(extra="forbid")

    history_items: NonEmptyInts | None = None
    history_sids: Annotated[list[list[StrictInt]], Field(min_length=1)] | None = None
    history_tokens: NonEmptyInts | None = None
    beam_width: Annotated[StrictInt, Field(ge=1)] | None = None  # None → the server's SearchConfig.beam_width
    top_n: Annotated[StrictInt, Field(ge=1)] = 10
    request_id: Annotated[StrictStr, Field(min_length=1, max_length=128)] | None = None

    @model_validator(mode="after")
    def _exactly_one_history(self) -> "RecommendRequest":
        given = [name for name in HISTORY_FIELDS if getattr(self, name) is not None]
        if not given:
            raise PydanticCustomError(
                "history_missing", "exactly one of history_items, history_sids, history_tokens is required")
        if len(given) > 1:
            raise PydanticCustomError(
                "history_ambiguous",
                "exactly one of history_items, history_sids, history_tokens may be given, got {given}",
                {"given": ", ".join(given)})
        return self

    @property
    def history_kind(self) -> str:
        return next(name for name in HISTORY_FIELDS if getattr(self, name) is not None)


class ItemOut(BaseModel):
    item_id: int
    sid: list[int]
    score: float  # summed log-probability of the SID tokens


class Timing(BaseModel):
    queue_ms: float  # arrival at the engine → batch start
    compute_ms: float  # batch start → result
    total_ms: float  # request received by the HTTP handler → response built


class RecommendResponse(BaseModel):
    request_id: str
    items: list[ItemOut]  # best first
    beam_width: int
    catalog_version: int
    timing: Timing
    batch_size: int  # requests in the engine batch that served this one


class CatalogReloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: Annotated[StrictStr, Field(min_length=1)]


class CatalogInfo(BaseModel):
    num_items: int
    version: int
    depth: int
    codebook_sizes: list[int]


class CatalogReloadResponse(BaseModel):
    catalog: CatalogInfo
    previous_version: int


class HealthResponse(BaseModel):
    status: str
    catalog: CatalogInfo
    queue_depth: int
    vocab_size: int


class ErrorDetail(BaseModel):
    message: str
    field: str | None = None  # e.g. "history_sids[3][1]"; None when the error is not about one field
    type: str  # machine-readable kind, e.g. "unknown_items", "out_of_range", "invalid_json"


class ErrorBody(BaseModel):
    error: ErrorDetail
