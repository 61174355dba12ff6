"""A ``/v1/recommend`` body → the engine's ``RetrievalRequest``: the search knobs (beam width, top_n, thinking), the
item filters (``exclude_items``, ``exclude_history``, the allowlist), the history as prompt tokens (``history.py``);
and the cheap length checks of the retrieval routes' raw bodies (run before they are validated). The retrieval server
and the offline ``Recommender`` convert through the same functions, so both take exactly the same inputs."""

from __future__ import annotations

from typing import Any

from grserve.config import BeamApiConfig, ServerConfig
from grserve.engine.protocol import RetrievalService
from grserve.engine.types import RetrievalRequest
from grserve.inputs.history import history_precheck, history_tokens
from grserve.inputs.house_schemas import RecommendRequest
from grserve.inputs.item_filters import allowed, check_excluded, check_included, excluded_items, history_exclusion
from grserve.inputs.limits import Precheck, PromptLimits, PromptTokenLimits
from grserve.inputs.refusal import ApiError
from grserve.inputs.sid_prompts import think_spec


def search_knobs(body: RecommendRequest, search: Any, server_cfg: ServerConfig) -> int:
    """The request's beam width (its own or the server default), range-checked with its top_n."""
    beam_width = body.beam_width if body.beam_width is not None else int(search.beam_width)
    if not 1 <= beam_width <= int(search.max_beam_width):
        raise ApiError(400, f"beam_width: {beam_width} is out of range [1, {search.max_beam_width}]",
                       "beam_width", "out_of_range")
    max_top_n = min(beam_width, int(server_cfg.max_top_n))
    if not 1 <= body.top_n <= max_top_n:
        raise ApiError(400, f"top_n: {body.top_n} is out of range [1, {max_top_n}] (at most beam_width "
                            f"{beam_width} and the server limit {server_cfg.max_top_n})", "top_n", "out_of_range")
    return beam_width


def recommend_think(body: RecommendRequest, catalog: Any, beams: Any) -> Any:
    """A /v1/recommend request's ``ThinkSpec`` (greedy) when ``max_think_tokens`` > 0, checked like the OpenAI
    routes' (the server limit, a layout with ``sid_begin``)."""
    return think_spec(beams, body.max_think_tokens, catalog.layout)


def text_limits(engine: RetrievalService, server_cfg: ServerConfig, beams: BeamApiConfig) -> PromptTokenLimits:
    """The cheap bounds of a text history and of the OpenAI beam routes' prompts (``limits.py``):
    ``--max-prompt-tokens`` x the model tokenizer's longest token in characters (no character bound without a
    tokenizer: text is refused anyway), messages and content parts at most ``--max-chat-messages``."""
    tok = getattr(engine, "tokenizer", None)
    return PromptTokenLimits(int(server_cfg.max_prompt_tokens), getattr(tok, "max_token_chars", None),
                             int(beams.max_chat_messages))


def _excluded_precheck(raw: dict, server_cfg: ServerConfig) -> None:
    if isinstance(raw.get("exclude_items"), list):
        check_excluded(len(raw["exclude_items"]), server_cfg)
    if isinstance(raw.get("include_items"), list):
        check_included(len(raw["include_items"]), server_cfg)


def recommend_precheck(engine: RetrievalService, server_cfg: ServerConfig,
                       limits: PromptLimits | None = None) -> Precheck:
    """The cheap length checks of ``/v1/recommend`` on its raw JSON (run before it is validated): the
    history as prompt tokens (a SID or an item lays out to ``depth`` tokens), a text history's characters and
    messages (``limits``), and ``exclude_items``."""

    def check(raw: Any) -> None:
        if not isinstance(raw, dict):
            return
        depth = int(engine.catalogs.current().depth)
        for name, tokens_each in (("history_tokens", 1), ("history_items", depth), ("history_sids", depth)):
            if isinstance(raw.get(name), list):
                history_precheck(raw, name, tokens_each, server_cfg)
        if limits is not None:
            if isinstance(raw.get("prompt"), str):
                limits.check_text("prompt", len(raw["prompt"]))
            limits.check_messages(raw.get("messages"))
        _excluded_precheck(raw, server_cfg)

    return check


def beam_completion_precheck(limits: PromptLimits, server_cfg: ServerConfig) -> Precheck:
    """The cheap length checks of the OpenAI beam route ``/v1/completions``: its prompt (characters, or token ids)
    and ``exclude_items`` / ``include_items``."""

    def check(raw: Any) -> None:
        if isinstance(raw, dict):
            limits.check_prompt(raw.get("prompt"))
            _excluded_precheck(raw, server_cfg)

    return check


def beam_chat_precheck(limits: PromptLimits, server_cfg: ServerConfig) -> Precheck:
    """The cheap length checks of the OpenAI beam route ``/v1/chat/completions``: its messages and
    ``exclude_items`` / ``include_items``."""

    def check(raw: Any) -> None:
        if isinstance(raw, dict):
            limits.check_messages(raw.get("messages"))
            _excluded_precheck(raw, server_cfg)

    return check


def retrieval_request(body: RecommendRequest, catalog: Any, engine: RetrievalService, server_cfg: ServerConfig,
                      beam_ctx: Any, beam_width: int | None = None) -> tuple[RetrievalRequest, int]:
    """The engine request of a ``/v1/recommend`` body against one catalog snapshot, and the number of history
    entries ``truncate`` cut (``ApiError`` naming the field otherwise). Also the offline API's conversion
    (``grserve.recommender``), so both take exactly the same inputs."""
    if beam_width is None:
        beam_width = search_knobs(body, engine.search, server_cfg)
    think, excluded = recommend_think(body, catalog, beam_ctx), excluded_items(body, server_cfg)  # cheap first
    include = allowed(body, catalog, server_cfg)
    prompt, dropped = history_tokens(body, catalog, int(engine.vocab_size), int(server_cfg.max_prompt_tokens),
                                     beam_ctx, body.truncate or server_cfg.truncate)
    # the engine's key (its cancel key) is the server's own: a client's request_id is only echoed, so a client
    # that reuses another's id and disconnects cancels nothing but its own request
    excluded = history_exclusion(body, catalog, prompt, excluded)
    req = RetrievalRequest(prompt_tokens=prompt, beam_width=beam_width, top_n=body.top_n, exclude_items=excluded,
                           include=include, think=think)
    return req, dropped
