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
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from grserve.server.http.errors import ApiError


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
