"""SIDs written as tokenizer tokens (``<s_a_12><s_b_3><s_c_7>``, ``<a_47><b_103>``), and their resolution against the
model's tokenizer into a tokenizer-native ``SidLayout``.

A catalog gives its SID text in one of three ways (``catalog/io.py``): token strings per item (jsonl ``sid_tokens``, the
LC-Rec / MiniOneRec index JSON), or codes plus one template per level in its header (``sid_token_templates``:
``["<s_a_{}>", "<s_b_{}>", "<s_c_{}>"]``), optionally with ``sid_begin`` / ``sid_end``. Token strings become codes
here: a level whose strings all read ``prefix<int>suffix`` with one prefix and suffix (and canonical integers) gets
that template and code = the integer; any other level gets code = the rank of the string among the level's
distinct strings (``vocab``).

``resolve_layout`` binds the text to a tokenizer: every string must encode to exactly one token (else
``SidTokenError`` naming the first one that does not); two codes of one level may not share a token.
``infer_sid_text`` recognises SID tokens among a tokenizer's added tokens (OneRec's ``<s_a_N>``, MiniOneRec / LC-Rec's
``<a_N>``, with ``<|sid_begin|>`` / ``<|sid_end|>``) for a catalog that declares no layout.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .errors import CatalogError
from .layout import SidLayout

_NUMBERED = re.compile(r"^(.*?)(0|[1-9][0-9]*)(\D*)$", re.S)
_ADDED_SID = re.compile(r"^<((?:[A-Za-z0-9]+_)*?)([a-z])_(0|[1-9][0-9]*)>$")
_WRAPPERS = {"sid_begin": ("<|sid_begin|>", "<sid_begin>"), "sid_end": ("<|sid_end|>", "<sid_end>")}
MAX_TOKEN_CHARS = 256


class TokenVocab(Protocol):
    """What resolution needs of a tokenizer (``engine.tokenizer.HFTokenizer`` has both)."""

    def encode_each(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's token ids, no special tokens added."""

    def added_tokens(self) -> dict[str, int]:
        """The tokenizer's added tokens, string → id."""


class SidTokenError(CatalogError):
    """A SID token string is not exactly one token of the model's tokenizer."""

    def __init__(self, source: str, what: str, text: str, n_tokens: int, index: int = 0,
                 item_id: int | None = None):
        self.source, self.what, self.text, self.n_tokens = source, what, text, n_tokens
        self.index = index  # position of the string among those resolved together
        self.item_id = item_id  # an item whose SID holds it, when known
        held = f" (held by item {item_id})" if item_id is not None else ""
        super().__init__(f"{source}: {what} {text!r}{held} is not exactly one token of the model's tokenizer (it "
                         f"encodes to {n_tokens} tokens); the catalog's SID tokens must be added tokens of the "
                         "tokenizer")

    def held_by(self, item_id: int) -> "SidTokenError":
        return SidTokenError(self.source, self.what, self.text, self.n_tokens, self.index, int(item_id))


@dataclass(frozen=True)
class SidText:
    """Per level a template (``"<a_{}>"``: code c is written ``<a_c>``) or a vocabulary (code c is ``vocab[c]``)."""

    templates: tuple[str | None, ...]
    vocab: tuple[tuple[str, ...] | None, ...]
    sid_begin: str | None = None
    sid_end: str | None = None

    def __post_init__(self) -> None:
        if len(self.templates) != len(self.vocab) or not self.templates:
            raise ValueError("SidText needs one template or vocabulary per level")
        for level, (t, v) in enumerate(zip(self.templates, self.vocab)):
            if (t is None) == (v is None):
                raise ValueError(f"level {level}: give a template or a vocabulary, not both")
            if t is not None and t.count("{}") != 1:
                raise ValueError(f"level {level}: a template has exactly one '{{}}' (got {len(t)} characters)")

    @classmethod
    def from_templates(cls, templates: Sequence[str], sid_begin: str | None = None, sid_end: str | None = None
                       ) -> "SidText":
        return cls(tuple(templates), (None,) * len(templates), sid_begin, sid_end)

    @property
    def depth(self) -> int:
        return len(self.templates)

    def strings(self, level: int, codes: np.ndarray) -> list[str]:
        t = self.templates[level]
        if t is not None:
            return [t.replace("{}", str(int(c))) for c in codes]
        vocab = self.vocab[level]
        return [vocab[int(c)] for c in codes]

    def item_text(self, sid: Sequence[int]) -> str:
        """One item as prompt text: ``sid_begin`` + its SID tokens + ``sid_end`` (those the layout has)."""
        body = "".join(self.strings(level, [c])[0] for level, c in enumerate(sid))
        return (self.sid_begin or "") + body + (self.sid_end or "")

    def header(self) -> dict:
        """The file-header keys that declare this text (``catalog/io.py``)."""
        out: dict = {}
        if all(t is not None for t in self.templates):
            out["sid_token_templates"] = list(self.templates)
        else:
            out["sid_token_vocab"] = [list(v) if v is not None else [t] for t, v in zip(self.templates, self.vocab)]
        for key in ("sid_begin", "sid_end"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    def describe(self) -> str:
        levels = [t if t is not None else f"{len(v)} tokens" for t, v in zip(self.templates, self.vocab)]
        wrap = f" wrapped in {self.sid_begin} … {self.sid_end}" if self.sid_begin or self.sid_end else ""
        return f"{self.depth} levels [{', '.join(levels)}]{wrap}"


# ---- text → codes ----------------------------------------------------------------------------------------------
def _string(value, where: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_TOKEN_CHARS:
        raise CatalogError(f"{where}: a SID token must be a non-empty string of at most {MAX_TOKEN_CHARS} "
                           "characters")
    return value


def parse_header(obj: dict, where: str) -> dict:
    """{"templates", "vocab", "sid_begin", "sid_end"} declared by a header object (keys it lacks left out)."""
    out: dict = {}
    if "sid_token_templates" in obj:
        ts = obj["sid_token_templates"]
        if not isinstance(ts, list) or not ts:
            raise CatalogError(f"{where}: 'sid_token_templates' must be a non-empty list of strings")
        out["templates"] = tuple(_string(t, where) for t in ts)
        if any(t.count("{}") != 1 for t in out["templates"]):
            raise CatalogError(f"{where}: each SID token template has exactly one '{{}}' (where the code goes)")
    if "sid_token_vocab" in obj:
        vs = obj["sid_token_vocab"]
        if not isinstance(vs, list) or not vs or not all(isinstance(v, list) and v for v in vs):
            raise CatalogError(f"{where}: 'sid_token_vocab' must be a non-empty list of non-empty string lists")
        out["vocab"] = tuple(tuple(_string(s, where) for s in v) for v in vs)
    for key in ("sid_begin", "sid_end"):
        if key in obj:
            out[key] = _string(obj[key], where)
    return out


def text_from_header(declared: dict, depth: int, where: str) -> SidText | None:
    """The SidText a header declares for codes (templates or a full vocabulary), or None when it declares none."""
    if "templates" not in declared and "vocab" not in declared:
        if "sid_begin" in declared or "sid_end" in declared:
            raise CatalogError(f"{where}: 'sid_begin' / 'sid_end' need 'sid_token_templates' or 'sid_token_vocab' "
                               "(or items given as 'sid_tokens')")
        return None
    if "vocab" in declared:
        levels = declared["vocab"]
        templates = tuple(v[0] if len(v) == 1 and "{}" in v[0] else None for v in levels)
        vocab = tuple(None if t is not None else v for t, v in zip(templates, levels))
    else:
        templates, vocab = declared["templates"], (None,) * len(declared["templates"])
    if len(templates) != depth:
        raise CatalogError(f"{where}: {len(templates)} SID token levels declared but the SIDs have depth {depth}")
    return SidText(templates, vocab, declared.get("sid_begin"), declared.get("sid_end"))


def codes_from_strings(columns: Sequence[np.ndarray], declared: dict, source: str) -> tuple[np.ndarray, SidText]:
    """Token strings per level (object arrays, one entry per item) → ([n, depth] codes, the SidText)."""
    depth, n = len(columns), len(columns[0])
    codes = np.empty((n, depth), dtype=np.int64)
    templates, vocab = [], []
    for level, col in enumerate(columns):
        uniq, inverse = np.unique(col, return_inverse=True)
        template, numbers = _as_template(uniq)
        if template is not None:
            codes[:, level] = numbers[inverse]
            templates.append(template)
            vocab.append(None)
        else:
            codes[:, level] = inverse
            templates.append(None)
            vocab.append(tuple(str(s) for s in uniq))
    text = SidText(tuple(templates), tuple(vocab), declared.get("sid_begin"), declared.get("sid_end"))
    if "templates" in declared and tuple(declared["templates"]) != text.templates:
        raise CatalogError(f"{source}: the items' SID tokens do not follow the declared sid_token_templates")
    return codes, text


def _as_template(uniq: np.ndarray) -> tuple[str | None, np.ndarray | None]:
    """("prefix{}suffix", the integers) when every string reads prefix<int>suffix with one prefix and suffix."""
    parts = [_NUMBERED.match(str(s)) for s in uniq]
    if not parts or any(m is None for m in parts):
        return None, None
    shapes = {(m.group(1), m.group(3)) for m in parts}
    if len(shapes) != 1:
        return None, None
    prefix, suffix = shapes.pop()
    return prefix + "{}" + suffix, np.array([int(m.group(2)) for m in parts], dtype=np.int64)


# ---- text → token ids ------------------------------------------------------------------------------------------
def _one_token_each(vocab: TokenVocab, strings: list[str], what: str, source: str) -> np.ndarray:
    ids = vocab.encode_each(strings)
    for k, (s, got) in enumerate(zip(strings, ids)):
        if len(got) != 1:
            raise SidTokenError(source, what, s, len(got), k)
    return np.array([got[0] for got in ids], dtype=np.int64)


def resolve_layout(text: SidText, codebook_sizes: Sequence[int], used: Sequence[np.ndarray], vocab: TokenVocab,
                   source: str, item_of_code: Any = None) -> SidLayout:
    """The tokenizer-native layout of ``text``. ``used[l]``: the codes the catalog's items use at level l (each
    must be one token); the other codes of a templated level get their token if the tokenizer has one, else −1.
    ``item_of_code(level, code)``: an item holding that code, named when its string is not one token."""
    tables = []
    for level, size in enumerate(codebook_sizes):
        ids = np.full(int(size), -1, dtype=np.int64)
        needed = np.unique(np.asarray(used[level], dtype=np.int64))
        what = f"level-{level} SID token"
        try:
            ids[needed] = _one_token_each(vocab, text.strings(level, needed), what, source)
        except SidTokenError as exc:  # name an item that holds the string (its code is needed[exc.index])
            if item_of_code is None:
                raise
            raise exc.held_by(item_of_code(level, int(needed[exc.index]))) from None
        if text.templates[level] is not None:  # the codes no item uses: their token where one exists
            rest = np.setdiff1d(np.arange(int(size)), needed)
            if rest.size:
                encoded = vocab.encode_each(text.strings(level, rest))
                ids[rest] = [got[0] if len(got) == 1 else -1 for got in encoded]
        _check_distinct(ids, text, level, source)
        tables.append(ids)
    wrap = {key: int(_one_token_each(vocab, [getattr(text, key)], key, source)[0])
            for key in ("sid_begin", "sid_end") if getattr(text, key) is not None}
    return SidLayout(len(tables), tuple(int(c) for c in codebook_sizes), level_tokens=tuple(tables), **wrap)


def _check_distinct(ids: np.ndarray, text: SidText, level: int, source: str) -> None:
    valid = np.flatnonzero(ids >= 0)
    order = valid[np.argsort(ids[valid], kind="stable")]
    same = np.flatnonzero(ids[order][1:] == ids[order][:-1])
    if same.size:
        a, b = order[same[0]], order[same[0] + 1]
        raise CatalogError(f"{source}: level-{level} codes {a} and {b} are written as the same token of the model's "
                           "tokenizer")


# ---- inference from the tokenizer ------------------------------------------------------------------------------
def infer_sid_text(added: dict[str, int], depth: int | None = None) -> tuple[SidText, tuple[int, ...]] | None:
    """(SidText, codebook sizes) from a tokenizer's added tokens of a recognisable SID pattern — ``<P_a_N>``,
    ``<P_b_N>``, … (P optional, e.g. OneRec's ``s``) for consecutive letters from ``a`` — or None. Among several
    families the one with the most tokens wins; ``depth`` keeps only its first ``depth`` levels (a catalog's)."""
    families: dict[str, dict[str, int]] = {}
    for token in added:
        m = _ADDED_SID.match(token)
        if m:
            prefix, letter, n = m.group(1), m.group(2), int(m.group(3))
            levels = families.setdefault(prefix, {})
            levels[letter] = max(levels.get(letter, -1), n)
    best = None
    for prefix, levels in families.items():
        letters = []
        for k in range(26):
            if chr(97 + k) not in levels:
                break
            letters.append(chr(97 + k))
        if len(letters) < 2:
            continue
        size = sum(levels[c] + 1 for c in letters)
        if best is None or size > best[0]:
            best = (size, prefix, letters, levels)
    if best is None:
        return None
    _, prefix, letters, levels = best
    if depth is not None:
        if len(letters) < depth:
            return None
        letters = letters[:depth]
    wraps = {key: next((w for w in names if w in added), None) for key, names in _WRAPPERS.items()}
    text = SidText.from_templates([f"<{prefix}{c}_{{}}>" for c in letters], wraps["sid_begin"], wraps["sid_end"])
    return text, tuple(levels[c] + 1 for c in letters)


# ---- a catalog on a model -------------------------------------------------------------------------------------
def bind_catalog(catalog, vocab: TokenVocab | None):
    """(the catalog under the layout it serves with on a model whose tokenizer is ``vocab``, a line saying what was
    inferred or None). A catalog with SID text is resolved against the tokenizer (an error without one); a catalog
    of codes that declares no layout takes SID tokens recognised among the tokenizer's added tokens, if any; any
    other catalog keeps its arithmetic layout."""
    used = [catalog.trie.codes[level] for level in range(catalog.depth)]
    if catalog.text is not None:
        if vocab is None:
            raise CatalogError(f"{catalog.source}: the catalog writes SIDs as tokenizer tokens "
                               f"({catalog.text.describe()}) but the model has no tokenizer files")
        layout = resolve_layout(catalog.text, catalog.codebook_sizes, used, vocab, catalog.source,
                                lambda level, code: _item_of_code(catalog, level, code))
        return catalog.with_layout(layout), None
    if catalog.declared or vocab is None:
        return catalog, None
    found = infer_sid_text(vocab.added_tokens(), catalog.depth)
    if found is None:
        return catalog, None
    text, sizes = found
    layout = resolve_layout(text, catalog.codebook_sizes, used, vocab, catalog.source,
                            lambda level, code: _item_of_code(catalog, level, code))
    note = (f"{catalog.source} declares no SID layout; inferred from the tokenizer's added tokens: {text.describe()} "
            f"(the tokenizer has {list(sizes)} codes per level)")
    return catalog.with_layout(layout, text), note


def _item_of_code(catalog, level: int, code: int) -> int:
    """The first item (in SID order) whose SID has ``code`` at ``level``."""
    return int(catalog.item_ids[int(np.flatnonzero(catalog.sids[:, level] == code)[0])])
