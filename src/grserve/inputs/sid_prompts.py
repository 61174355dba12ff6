"""Chat and text prompts for a SID beam search: the client writes its history's items as SID token text
(``<|sid_begin|><s_a_12><s_b_3><s_c_7><|sid_end|>``, ``<a_47><b_103><c_234>``); the prompt is rendered with the
model's own chat template (transformers), checked, encoded with the model's tokenizer, and ends where the beams
start: right after ``sid_begin`` when the layout has one (appended unless the prompt already ends with it, or the
model is to think first and write it itself).

The check: every piece of text shaped like one of the catalog's SID tokens (a templated level: ``<s_a_N>``) must be a
token of the served layout (a code inside the level's codebook that the tokenizer has), and where the layout wraps
items, every ``sid_begin`` must open exactly one whole item (the depth's SID tokens, level after level, then
``sid_end``) — except one that ends a completion prompt (where the beams start). Otherwise a 400 names the field and
quotes the offending text: malformed SID text would be tokenized into word pieces and silently change the prompt.

``BeamContext`` is what a prompt needs besides its text (the engine's tokenizer and search defaults, the limits,
``--prompt-template``); ``beam_knobs`` and ``beam_request`` turn an OpenAI beam request into the engine's
``RetrievalRequest`` (the retrieval server's ``/v1/chat/completions`` and ``/v1/completions``, ``server/retrieval/
beams.py``); ``prompt_tokens`` is ``/v1/recommend``'s text history (``history.py``).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from grserve.catalog.allowlist import Allow
from grserve.config import BeamApiConfig, ServerConfig
from grserve.engine.protocol import RetrievalService
from grserve.engine.think import ThinkSpec
from grserve.engine.types import RetrievalRequest
from grserve.inputs.beam_schemas import BeamRequest
from grserve.inputs.item_filters import allowed, excluded_items, history_exclusion
from grserve.inputs.prompt_template import PromptTemplate, PromptTemplateError
from grserve.inputs.refusal import ApiError, check_length


def _level_patterns(catalog: Any) -> list[str]:
    """One regex per level matching exactly that level's SID token text (templates: any number, checked later)."""
    text = catalog.text
    out = []
    for level in range(catalog.depth):
        t = text.templates[level]
        if t is not None:
            prefix, _, suffix = t.partition("{}")
            out.append(re.escape(prefix) + r"([0-9]+)" + re.escape(suffix))
        else:
            out.append("(" + "|".join(re.escape(s) for s in sorted(text.vocab[level], key=len, reverse=True)) + ")")
    return out


def _patterns(catalog: Any) -> dict:
    """The compiled patterns of a catalog's SID text (built once per catalog object)."""
    cached = catalog.__dict__.get("_sid_prompt_patterns")
    if cached is None:
        levels = _level_patterns(catalog)
        text = catalog.text
        shaped = [(level, re.compile(p)) for level, p in enumerate(levels) if text.templates[level] is not None]
        item = None
        if text.sid_begin is not None and text.sid_end is not None:
            item = re.compile(re.escape(text.sid_begin) + "".join(levels) + re.escape(text.sid_end))
        cached = catalog.__dict__["_sid_prompt_patterns"] = {"shaped": shaped, "item": item}
    return cached


def _quote(s: str) -> str:
    return repr(s if len(s) <= 60 else s[:57] + "...")


def check_sid_text(text: str, field: str, catalog: Any, ends_at_beam: bool = False) -> None:
    """400 ``malformed_sid`` for SID-shaped text that is not a SID token of the served layout, or a wrapped item
    that is not whole (see the module docstring). ``ends_at_beam``: a trailing ``sid_begin`` is where the beams
    start."""
    if catalog.text is None:
        return
    pats, layout, sid_text = _patterns(catalog), catalog.layout, catalog.text
    for level, pat in pats["shaped"]:
        for m in pat.finditer(text):
            digits = m.group(1)
            code = int(digits)
            ok = str(code) == digits and code < catalog.codebook_sizes[level] and \
                layout.code_tokens(level)[code] >= 0
            if not ok:
                raise ApiError(400, f"{field}: {_quote(m.group(0))} is not a level-{level} SID token of the served "
                                    f"model (codes 0 to {catalog.codebook_sizes[level] - 1} that its tokenizer has)",
                               field, "malformed_sid")
    if pats["item"] is None:
        return
    begin, end = sid_text.sid_begin, sid_text.sid_end
    covered = [(m.start(), m.end()) for m in pats["item"].finditer(text)]
    starts, ends = {a for a, _ in covered}, {b for _, b in covered}
    for m in re.finditer(re.escape(begin), text):
        if m.start() not in starts and not (ends_at_beam and m.end() == len(text.rstrip())):
            raise ApiError(400, f"{field}: {_quote(text[m.start():m.start() + 80])} does not hold one whole item "
                                f"({catalog.depth} SID tokens between {begin} and {end})", field, "malformed_sid")
    for m in re.finditer(re.escape(end), text):
        if m.end() not in ends:
            raise ApiError(400, f"{field}: {_quote(text[max(0, m.end() - 80):m.end()])} closes no whole item",
                           field, "malformed_sid")


def beam_start(ids: list[int], layout: Any, thinking: bool) -> np.ndarray:
    """The prompt tokens the beams (or the thought) start after: ``sid_begin`` appended when the layout has one,
    the prompt does not end with it and the model does not think first."""
    begin = layout.sid_begin
    if begin is not None and not thinking and (not ids or ids[-1] != begin):
        ids = [*ids, begin]
    return np.asarray(ids, dtype=np.int64)


def item_text(catalog: Any, sid: tuple[int, ...]) -> str:
    """An answer's SID text: as the model writes the item (its tokens, wrapped), or the codes dash-joined when the
    catalog's SIDs have no token text (an arithmetic layout)."""
    if catalog.text is not None:
        return catalog.text.item_text(sid)
    return "-".join(str(int(c)) for c in sid)


def chat_text(tokenizer: Any, messages: list[dict], kwargs: dict | None) -> str:
    """The conversation rendered by the model's own chat template, ready for the assistant's answer."""
    from grserve.engine.tokenizer import ChatTemplateError

    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, **(kwargs or {}))
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), "messages", "chat_template_error") from None


# ----------------------------------------------------------------------------------------------------------
# the beam routes' context and requests (the retrieval server's OpenAI routes, and a text history)
# ----------------------------------------------------------------------------------------------------------
@dataclass
class BeamContext:
    """What the routes need: the engine (or cluster front end), the limits, the served model's name."""

    engine: RetrievalService
    server: ServerConfig
    beams: BeamApiConfig
    model_name: str
    metrics: Any  # the server's Metrics (items answered); None offline
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_template: PromptTemplate | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        """``--prompt-template``, loaded and tried once at start-up (a bad file or variable fails here, not later)."""
        path = getattr(self.beams, "prompt_template", None)
        if path is None:
            return
        if getattr(self.engine, "tokenizer", None) is None:
            raise PromptTemplateError(f"--prompt-template {path}: the model has no tokenizer to encode its text")
        template = PromptTemplate.load(path, self.beams.prompt_format)
        template.render(["<item>"], [0])
        self.prompt_template = template

    @property
    def tokenizer(self) -> Any:
        tok = getattr(self.engine, "tokenizer", None)
        if tok is None:
            raise ApiError(400, f"the served model '{self.model_name}' has no tokenizer files, so text and chat "
                                "prompts cannot be encoded; send token ids (/v1/completions with a list prompt) or "
                                "use /v1/recommend", None, "no_tokenizer")
        return tok

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ApiError(404, f"the model '{name}' does not exist (served: '{self.model_name}')", "model",
                           "model_not_found")


def _beam_width(ctx: BeamContext, body: BeamRequest) -> int:
    search = ctx.engine.search
    bw = body.requested_beam_width() or int(search.beam_width)
    param = "beam_width" if body.beam_width is not None else "best_of"
    if bw > int(search.max_beam_width):
        raise ApiError(400, f"{param}: {bw} is more than the server's --max-beam-width {search.max_beam_width}", param,
                       "out_of_range")
    limit = min(bw, int(ctx.server.max_top_n))
    if body.n > limit:
        raise ApiError(400, f"n: {body.n} results asked for, at most the beam width {bw} and the server limit "
                            f"{ctx.server.max_top_n}", "n", "out_of_range")
    return bw


def think_spec(ctx: BeamContext, max_think_tokens: int, layout: Any, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, seed: int | None = None) -> ThinkSpec | None:
    """The request's ``ThinkSpec``, None without thinking; 400 over ``--max-think-tokens``. A layout without
    ``sid_begin`` ends the thought at the model's first SID token (``engine/think.py``)."""
    if max_think_tokens == 0:
        return None
    limit = int(ctx.beams.max_think_tokens)
    if max_think_tokens > limit:
        raise ApiError(400, f"max_think_tokens: {max_think_tokens} is more than the server limit {limit} "
                            "(--max-think-tokens)", "max_think_tokens", "out_of_range")
    if layout.sid_begin is None:  # the model's own first SID token ends the thought (engine/think.py)
        first = layout.code_tokens(0)
        return ThinkSpec(max_think_tokens, None, temperature, top_p, top_k, seed,
                         frozenset(int(t) for t in first[first >= 0].tolist()))
    return ThinkSpec(max_think_tokens, int(layout.sid_begin), temperature, top_p, top_k, seed)


@dataclass(frozen=True)
class BeamKnobs:
    """A request's search settings, checked before its prompt is rendered or tokenized."""

    beam_width: int
    think: ThinkSpec | None
    exclude_items: np.ndarray | None
    include: Allow | None = None


def beam_knobs(ctx: BeamContext, body: BeamRequest, catalog: Any) -> BeamKnobs:
    """The cheap checks of a request (400 naming the field): beam width and n, max_tokens vs one item, thinking,
    ``exclude_items`` (413 past ``--max-exclude-items``), the allowlist (``include_items``, ``include_sid_prefix``)."""
    bw = _beam_width(ctx, body)
    max_tokens = body.requested_max_tokens()
    if max_tokens is not None and max_tokens < catalog.depth:
        param = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
        raise ApiError(400, f"{param}: {max_tokens} is less than the {catalog.depth} tokens of one item", param,
                       "out_of_range")
    spec = think_spec(ctx, body.max_think_tokens, catalog.layout, body.temperature, body.top_p, body.top_k,
                      body.seed)

    return BeamKnobs(bw, spec, excluded_items(body, ctx.server), allowed(body, catalog, ctx.server))


def beam_request(ctx: BeamContext, body: BeamRequest, ids: list[int], catalog: Any, knobs: BeamKnobs,
                      field_name: str) -> RetrievalRequest:
    """The engine request of a prompt's token ids: beam start placed, its length checked (413 a prompt too long).
    Its ``request_id`` is the server's own (the engine's cancel key)."""
    prompt = beam_start(ids, catalog.layout, knobs.think is not None)
    check_length(int(prompt.size), int(ctx.server.max_prompt_tokens), field_name, "the prompt", "prompt_too_long")
    return RetrievalRequest(prompt_tokens=prompt, beam_width=knobs.beam_width, top_n=body.n, think=knobs.think,
                            exclude_items=history_exclusion(body, catalog, prompt, knobs.exclude_items),
                            include=knobs.include, logprobs=body.wants_logprobs())


def chat_ids(tok: Any, catalog: Any, messages: list, template_kwargs: dict | None) -> list[int]:
    """A chat's prompt token ids: each message's SID text checked, the chat rendered with the model's chat template,
    encoded (a heavy-work thread's job: ``off_loop``)."""
    rendered = [m.for_template() for m in messages]
    for i, m in enumerate(rendered):
        check_sid_text(m["content"] or "", f"messages[{i}].content", catalog)
    return tok.encode(chat_text(tok, rendered, template_kwargs), add_special_tokens=False)


def text_ids(tok: Any, catalog: Any, prompt: str) -> list[int]:
    """A text prompt's token ids: its SID text checked (a trailing ``sid_begin`` is where the beams start), encoded
    (a heavy-work thread's job)."""
    check_sid_text(prompt, "prompt", catalog, ends_at_beam=True)
    return tok.encode(prompt)


def prompt_tokens(ctx: BeamContext, catalog: Any, prompt: str | None, messages: list | None) -> np.ndarray:
    """``/v1/recommend``'s ``prompt`` / ``messages`` history as token ids (chat template, checks; the caller runs it
    on a heavy-work thread)."""
    ids = chat_ids(ctx.tokenizer, catalog, messages, None) if messages is not None else \
        text_ids(ctx.tokenizer, catalog, prompt or "")
    return np.asarray(ids, dtype=np.int64)
