"""Structured output: a per-request grammar that masks the tokens the sampler may choose (xgrammar).

A request asks for one ``StructuredSpec`` (``SamplingParams.structured``): ``json_object`` (any JSON object),
``json_schema`` (the JSON text of a schema), ``regex``, ``choice`` (a JSON list of strings: exactly one of them),
or ``grammar`` (EBNF in xgrammar's / GBNF's syntax). The spec is plain text, so it travels to an engine-core
process with the request; the engine compiles it there (``StructuredBackend``: one ``xgrammar.GrammarCompiler``
over the tokenizer's vocabulary, which caches compiled grammars) and keeps one ``GrammarMatcher`` per request.

Each engine step, for the requests that sample and carry a matcher, ``fill_bitmasks`` asks every matcher for its
allowed-token bitmask (int32 words, bit j of word w = token 32·w + j); the sampler adds −inf to every other token's
logit before anything else (``sampling.process_logits``, where ``logit_bias`` is applied), and the engine advances
the matcher with the token it appends. The stop tokens (EOS and the model's other end ids) are allowed only where
the grammar is complete, and a matcher that has accepted one is done: the request stops ("stop"). A constrained
request never takes the screened greedy head (``SamplingParams.plain_greedy`` is False for it).

``check(spec)`` parses the spec without a tokenizer (the API's 400 for a schema, regex or grammar xgrammar cannot
compile); ``StructuredBackend.matcher`` raises ``GrammarError`` (a ``ValueError``) the same way in the engine.

JSON is generated compact (``any_whitespace=False``: ``{"a": 1, "b": [2, 3]}``, no free whitespace between
tokens), so a model cannot spend its tokens on whitespace; strings, numbers and arrays are as long as the schema
allows (``maxLength``, ``maxItems``, ...): bound them when the output must end within ``max_tokens``.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: .*? is false: )?")


class GrammarError(ValueError):
    """A structured-output spec that cannot be compiled (the API answers 400)."""


@dataclass(frozen=True)
class StructuredSpec:
    kind: str  # one of KINDS
    text: str = ""  # the schema's JSON text, the regex, the JSON list of choices, or the EBNF grammar

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")


def _message(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    return _CPP_PREFIX.sub("", lines[0] if lines else type(exc).__name__).strip()


def _choice_ebnf(text: str) -> str:
    choices = json.loads(text)
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise GrammarError("choice must be a non-empty list of strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))


def _grammar(spec: StructuredSpec) -> Any:
    """The spec as an ``xgrammar.Grammar`` (no tokenizer needed); ``GrammarError`` if it does not compile."""
    import xgrammar as xgr

    try:
        if spec.kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "json_schema":
            return _json_strings(xgr.Grammar.from_json_schema(spec.text, any_whitespace=False, strict_mode=True))
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.text)
        if spec.kind == "choice":
            return xgr.Grammar.from_ebnf(_choice_ebnf(spec.text))
        return xgr.Grammar.from_ebnf(spec.text)
    except GrammarError:
        raise
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError (C++) and ValueError
        raise GrammarError(_message(exc)) from None


_LOOSE_CHAR = r'[^\"\\\r\n]'  # xgrammar 0.2's string character under maxLength / minLength: admits U+0000-U+001F
_JSON_CHAR = r'[^\0-\x1f\"\\]'  # what JSON admits unescaped


def _json_strings(grammar: Any) -> Any:
    """xgrammar writes a string with a length bound as characters ``[^"\\\r\n]``, which lets control characters
    through (invalid JSON: a strict parser refuses them); rewrite those to JSON's ``[^\0-\x1f"\\]``."""
    import xgrammar as xgr

    text = str(grammar)
    if _LOOSE_CHAR not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_CHAR, _JSON_CHAR))


def json_schema_ebnf(schema_text: str, root: str) -> str:
    """The EBNF of a JSON schema (compact, JSON-valid strings) with its root rule named ``root``, to embed in a
    larger grammar (a tool call's tags around it); ``GrammarError`` if it does not compile."""
    text = str(_grammar(StructuredSpec("json_schema", schema_text)))
    if re.search(rf"^{re.escape(root)} ::=", text, re.MULTILINE):
        raise GrammarError(f"rule name {root!r} is taken")
    return re.sub(r"^root ::=", f"{root} ::=", text, count=1, flags=re.MULTILINE)


def check(spec: StructuredSpec) -> None:
    """Raise ``GrammarError`` (with xgrammar's reason) when ``spec`` cannot be compiled."""
    _grammar(spec)


class StructuredBackend:
    """Compiles specs against one tokenizer's vocabulary (``vocab_size`` = the model's logits width, which may
    exceed the tokenizer's: the extra ids are never allowed) and makes a matcher per request. Built lazily by the
    engine on the first constrained request (the vocabulary scan costs ~0.1 s for 32k tokens)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int], cache_size: int = 256):
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = [int(t) for t in stop_token_ids if t is not None and 0 <= int(t) < vocab_size]
        self.cache_size = cache_size
        self._compiler: Any = None
        self._cache: OrderedDict[StructuredSpec, Any] = OrderedDict()
        self._lock = threading.Lock()

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            info = _tokenizer_info(self.hf_tokenizer, self.vocab_size, self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def has(self, spec: StructuredSpec) -> bool:
        """``spec`` is compiled already: a matcher for it costs no compile."""
        with self._lock:
            return spec in self._cache

    def compiled(self, spec: StructuredSpec) -> Any:
        """The compiled grammar of ``spec`` (cached, LRU). The compile itself (0.01 s to over a second for a large
        schema) runs outside the lock: a cached spec's matcher never waits behind another spec's compile."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
            compiler = self._get_compiler()
        out = compiler.compile_grammar(_grammar(spec))
        with self._lock:
            self._cache[spec] = out
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return out

    def matcher(self, spec: StructuredSpec) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compiled(spec))

    @property
    def words(self) -> int:
        return (self.vocab_size + 31) // 32


def _tokenizer_info(hf: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
    """xgrammar's view of the vocabulary, with the special tokens (``<bos>``, ``<pad>``, chat markers: the ones
    a decode with ``skip_special_tokens`` drops) as empty strings, which no grammar allows; xgrammar would otherwise
    read ``<bos>`` as the five characters, let it into a JSON string, and the text would lose it."""
    import xgrammar as xgr

    base = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None)
    special = set(getattr(hf, "all_special_ids", ())) | {
        i for i, t in getattr(hf, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    if not special - set(stop_token_ids):
        return base
    vocab = [""] * vocab_size
    for token, i in hf.get_vocab().items():
        if 0 <= i < vocab_size and i not in special:
            vocab[i] = token
    return xgr.TokenizerInfo(vocab, vocab_type=base.vocab_type, vocab_size=vocab_size,
                             stop_token_ids=base.stop_token_ids, add_prefix_space=base.add_prefix_space)


def fill_bitmasks(matchers: list[Any], words: int) -> np.ndarray:
    """One int32 bitmask row [words] per matcher (allowed next tokens), as a numpy array [n, words]."""
    bm = torch.empty((len(matchers), words), dtype=torch.int32)
    for i, m in enumerate(matchers):
        m.fill_next_token_bitmask(bm, i)
    return bm.numpy()


# byte value -> the 8 additions (0 allowed, -inf not) of its bits, least significant first: the bitmask's int32 words
# are little-endian, so byte k of a row holds tokens 8k ... 8k + 7
_BYTE_ADD = np.where((np.arange(256)[:, None] >> np.arange(8)[None, :]) & 1, 0.0, -np.inf)
_scratch = threading.local()


def _buffer(n: int, nbytes: int) -> np.ndarray:
    """A per-thread float64 [n, nbytes, 8] scratch array, reused across steps: a fresh 2 MB array per step costs
    its page faults (about 2 ms at batch 8 of a 32k vocabulary), more than the mask itself."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.shape[0] < n or buf.shape[1] != nbytes:
        buf = np.empty((max(n, 8), nbytes, 8))
        _scratch.buf = buf
    return buf[:n]


def mask_logits(x: torch.Tensor, sel: list[int], bitmasks: np.ndarray) -> None:
    """Set the logits of ``x`` (float64 [B, V], in place) that ``bitmasks`` [len(sel), words] disallows to −inf in
    the rows ``sel``: each bitmask byte looks up its 8 additions (0 / −inf) into a reused buffer, which is added to
    the rows (branch-free, no allocation)."""
    B, V = x.shape
    u8 = np.ascontiguousarray(bitmasks, dtype=np.int32).view(np.uint8)
    if u8.shape[1] * 8 < V:  # a bitmask narrower than the logits: the ids beyond it are not allowed
        u8 = np.pad(u8, ((0, 0), (0, -(-V // 8) - u8.shape[1])))
    buf = _buffer(len(sel), u8.shape[1])
    _BYTE_ADD.take(u8, axis=0, out=buf)
    add = buf.reshape(len(sel), -1)[:, :V]
    if x.device.type == "cpu" and x.dtype == torch.float64 and x.is_contiguous() and len(sel) == B:
        xn = x.numpy()
        np.add(xn, add, out=xn)
    elif len(sel) == B:
        x += torch.from_numpy(add).to(device=x.device, dtype=x.dtype)
    else:
        x[sel] += torch.from_numpy(add).to(device=x.device, dtype=x.dtype)
