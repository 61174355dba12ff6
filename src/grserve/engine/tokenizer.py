"""Tokenizers for the LLM API: an HF tokenizer through ``transformers.AutoTokenizer``, or a preset's byte-level
tokenizer that grserve writes as an HF directory (so clients such as ``aiperf --tokenizer DIR`` load the same one).

Every tokenizer offers ``encode``, ``decode``, ``decode_stream(prompt_ids)`` (an incremental decoder: one
``step(token_id) -> new text`` per generated token, never re-decoding the output), ``apply_chat_template`` (errors
→ ``ChatTemplateError``, a 400 at the API), ``token_bytes`` (for logprobs), ``eos_token_id``, ``vocab_size``.

- ``HFTokenizer``: ``AutoTokenizer.from_pretrained(dir)`` and its own ``apply_chat_template`` with the full context
  (``tools``, the special tokens, ``chat_template.jinja`` — whatever transformers gives a template). A
  ``tokenizer.json`` that stores padding or truncation does not pad or truncate prompts (both are switched off on
  the backend). Incremental decoding is ``tokenizers.decoders.DecodeStream``; ids past the tokenizer's vocabulary
  (models often have a few spare rows) decode to nothing.
- ``preset_tokenizer_json(vocab_size)``: the presets' tokenizer, built deterministically with ``tokenizers``: a
  byte-level BPE (ids 0/1/2 = ``<pad>``/``<bos>``/``<eos>``, byte b = id b + 3, ``<bos>`` prepended) whose other
  ids, up to the model's vocabulary, are filler words (``" a"`` … ``" z"``, ``" aa"``, ``" ab"``, …) each reachable
  by one merge of an earlier one and a letter. A random-weight preset therefore writes words, and a client that
  re-tokenizes the output text (aiperf counts output tokens so) counts about the tokens the server generated.
  Text without a space before a lowercase letter encodes to bytes. ``write_preset_tokenizer``
  writes ``tokenizer.json`` + ``tokenizer_config.json`` + ``chat_template.jinja`` (a minimal template:
  ``<bos>``, then ``<|role|>\\n`` + content + ``\\n`` per message, ``<|assistant|>\\n`` to generate).
  Chat prompts are encoded without adding special tokens (the template has them), as vLLM does.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

SPECIALS = ("<pad>", "<bos>", "<eos>")
BYTE_OFFSET = 3
CHAT_TEMPLATE = (
    "{{- bos_token }}{%- if tools %}{{ '<|tools|>\\n' + (tools | tojson) + '\\n' }}{% endif %}\n"
    "{%- for m in messages %}\n"
    "{{- '<|' + m['role'] + '|>\\n' }}\n"
    "{%- if m['content'] is string %}{{ m['content'] }}"
    "{%- elif m['content'] %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}\n"
    "{%- if m['tool_calls'] %}{{ m['tool_calls'] | tojson }}{% endif %}\n"
    "{%- if m['tool_call_id'] %}{{ ' [' + m['tool_call_id'] + ']' }}{% endif %}\n"
    "{{- '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The chat template could not render this conversation (it raised, or the tokenizer has none)."""


class MissingTokenizerError(ChatTemplateError):
    """Text or chat input for a model directory that has no tokenizer files."""


class WindowDecoder:
    """Incremental detokenization from a plain ``decode(ids)`` (vLLM's offsets scheme): each step decodes only the
    few tokens since the last emitted text (a prefix window for context), never the whole output. Text that ends
    in an unfinished UTF-8 character (U+FFFD) is held until the character completes, or for at most
    ``MAX_HELD`` tokens (then emitted as U+FFFD)."""

    MAX_HELD = 4  # a UTF-8 character is at most 4 bytes

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0  # start of the context window
        self.read = 0  # tokens whose text was emitted

    def step(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self.decode(self.ids[self.prefix:self.read])
        full = self.decode(self.ids[self.prefix:])
        if len(full) > len(before) and (not full.endswith("\ufffd") or len(self.ids) - self.read >= self.MAX_HELD):
            self.prefix, self.read = self.read, len(self.ids)
            return full[len(before):]
        return ""


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level alphabet (GPT-2's): printable bytes stand for themselves, the others for chars from 256."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


BYTE_CHARS = _bytes_to_unicode()
CHAR_BYTES = {c: b for b, c in BYTE_CHARS.items()}


def _filler(k: int) -> str:
    """The k-th filler token: a space and a lowercase word (a, …, z, aa, ab, …, zz, aaa, …) in byte-level
    characters. Every filler's prefix one letter shorter is an earlier filler (or the space alone)."""
    length, n = 1, 26
    while k >= n:
        k -= n
        length += 1
        n = 26 ** length
    word = "".join(chr(97 + (k // 26 ** i) % 26) for i in reversed(range(length)))
    return BYTE_CHARS[32] + word


def preset_tokenizer_json(vocab_size: int) -> str:
    """The presets' byte-level BPE tokenizer as ``tokenizer.json`` text (deterministic for a vocab size)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if vocab_size < 259:
        raise ValueError("the byte-level tokenizer needs a vocabulary of at least 259 ids")
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    vocab.update({BYTE_CHARS[b]: b + BYTE_OFFSET for b in range(256)})
    fillers = [_filler(i - 259) for i in range(259, vocab_size)]
    vocab.update({f: i for i, f in enumerate(fillers, start=259)})
    merges = [(f[:-1], f[-1]) for f in fillers]  # " ab" = (" a", "b"): encoding a filler's text gives the filler
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                       special_tokens=[("<bos>", 1)])
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tok.to_str()


def preset_tokenizer_files(vocab_size: int, model_max_length: int) -> dict[str, str]:
    """The files of the presets' tokenizer directory, by name, as this version writes them."""
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
           "pad_token": "<pad>", "model_max_length": model_max_length, "clean_up_tokenization_spaces": False}
    return {"tokenizer.json": preset_tokenizer_json(vocab_size),
            "tokenizer_config.json": json.dumps(cfg, indent=1),
            "special_tokens_map.json": json.dumps({"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}),
            "chat_template.jinja": CHAT_TEMPLATE}


def _write_atomic(path: Path, text: str) -> None:
    """``path`` holds ``text`` whole or keeps what it held (a temporary file renamed over it)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def write_preset_tokenizer(directory: str | Path, vocab_size: int, model_max_length: int) -> Path:
    """Write the presets' tokenizer as an HF directory loadable by ``AutoTokenizer.from_pretrained`` (each file
    atomically: a crash mid-write never leaves a torn file)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    for name, text in preset_tokenizer_files(vocab_size, model_max_length).items():
        _write_atomic(d / name, text)
    return d


class _DecodeStream:
    """``tokenizers.decoders.DecodeStream`` over a request's output; ids outside the tokenizer decode to ''.
    The stream is primed with the prompt's last tokens (their text discarded), so the first generated token is
    decoded in context: a SentencePiece-style decoder keeps its leading space, as decoding prompt + output does."""

    PRIME = 4

    def __init__(self, backend: Any, size: int, prompt_ids: list[int] | None = None) -> None:
        from tokenizers.decoders import DecodeStream

        self.backend, self.size = backend, size
        self.stream = DecodeStream(skip_special_tokens=True)
        for t in (prompt_ids or [])[-self.PRIME:]:
            self.step(t)

    def step(self, token_id: int) -> str:
        if not 0 <= token_id < self.size:
            return ""
        return self.stream.step(self.backend, token_id) or ""


def _generation_eos(d: Path, eos: int | None) -> tuple[int, ...]:
    """End-of-sequence ids a model's ``generation_config.json`` adds to the tokenizer's (chat models often end
    turns with another token, e.g. Qwen's ``<|im_end|>``); they stop generation like EOS."""
    try:
        ids = json.loads((d / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return ()
    ids = ids if isinstance(ids, list) else [ids]
    return tuple(i for i in dict.fromkeys(ids) if isinstance(i, int) and i != eos)


class HFTokenizer:
    """``transformers.AutoTokenizer`` from a directory, with its own chat template."""

    def __init__(self, model_dir: str | Path):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(model_dir))
        self.tok.model_max_length = 1 << 62  # the server checks prompt lengths itself (no transformers warning)
        backend = getattr(self.tok, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(f"{model_dir}: only fast (tokenizer.json) tokenizers are supported")
        backend.no_padding()
        backend.no_truncation()
        self.backend = backend
        self.name_or_path = str(model_dir)
        self.eos_token_id = self.tok.eos_token_id
        self.bos_token_id = self.tok.bos_token_id
        self.vocab_size = len(self.tok)
        self.extra_eos_ids = _generation_eos(Path(model_dir), self.eos_token_id)
        self._byte_level = type(backend.decoder).__name__ == "ByteLevel"
        self._max_token_chars: int | None = None

    @property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry, in characters (a byte-level BPE's entries have one character a byte): no
        token covers more characters of text, so a text of more than ``n * max_token_chars`` characters is more
        than n tokens."""
        if self._max_token_chars is None:
            self._max_token_chars = max((len(t) for t in self.tok.get_vocab()), default=1)
        return self._max_token_chars

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode([i for i in ids if 0 <= i < self.vocab_size], skip_special_tokens=skip_special_tokens)

    def decode_stream(self, prompt_ids: list[int] | None = None) -> _DecodeStream:
        return _DecodeStream(self.backend, self.vocab_size, prompt_ids)

    def encode_each(self, texts) -> list[list[int]]:
        """Each text's ids, no special tokens added (one batch call; SID token resolution, ``catalog/sid_text``)."""
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def added_tokens(self) -> dict[str, int]:
        """The tokenizer's added tokens, string → id."""
        return dict(self.tok.get_added_vocab())

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.vocab_size:
            return b""
        piece = self.tok.convert_ids_to_tokens(token_id)
        if self._byte_level and piece is not None and all(c in CHAR_BYTES for c in piece):
            return bytes(CHAR_BYTES[c] for c in piece)
        return self.tok.decode([token_id]).encode("utf-8")

    def apply_chat_template(self, messages: list[dict], tools: list | None = None,
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """``kwargs``: extra template variables (vLLM's ``chat_template_kwargs``, e.g. ``enable_thinking``)."""
        if not self.tok.chat_template:
            raise ChatTemplateError(f"the tokenizer of {self.name_or_path} has no chat template")
        try:
            return self.tok.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                                tokenize=False, **kwargs)
        except Exception as exc:  # jinja's TemplateError, raise_exception(...), a template's own TypeError
            raise ChatTemplateError(f"the chat template failed: {exc}") from exc


def user_cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """Where the presets' tokenizers are cached by default: ``$GRSERVE_CACHE_DIR/tokenizers``, else
    ``$XDG_CACHE_HOME/grserve/tokenizers``, else ``~/.cache/grserve/tokenizers`` (never the working directory)."""
    if environ.get("GRSERVE_CACHE_DIR"):
        return Path(environ["GRSERVE_CACHE_DIR"]).expanduser() / "tokenizers"
    base = environ.get("XDG_CACHE_HOME") or str(Path("~").expanduser() / ".cache")
    return Path(base).expanduser() / "grserve" / "tokenizers"


def preset_tokenizer_dir(cache_dir: str | Path, vocab_size: int, model_max_length: int) -> Path:
    """The presets' tokenizer directory under ``cache_dir``: reused only when every file in it is exactly what this
    version writes (verified byte for byte), else (re)written — a stale, torn or foreign file is never loaded."""
    d = (Path(cache_dir) / f"grserve-bytes-v2-{vocab_size}").resolve()
    files = preset_tokenizer_files(vocab_size, model_max_length)
    if any(_read(d / name) != text for name, text in files.items()):
        Path(cache_dir).mkdir(parents=True, exist_ok=True, mode=0o700)
        write_preset_tokenizer(d, vocab_size, model_max_length)
    return d


class NoTokenizer:
    """The tokenizer of a model directory that has none. Token ids in and out still work (output text is empty);
    text and chat input raise ``MissingTokenizerError`` naming the directory: the model's own tokenizer is the only
    one whose text means anything to it."""

    eos_token_id = bos_token_id = None
    extra_eos_ids: tuple[int, ...] = ()
    chat_template = None

    def __init__(self, model_dir: str | Path, vocab_size: int):
        self.name_or_path = str(model_dir)
        self.vocab_size = int(vocab_size)
        self.message = (f"the model directory {model_dir} has no tokenizer files (tokenizer.json or "
                        "tokenizer_config.json): text and chat input need the model's own tokenizer; send token ids, "
                        "or add the tokenizer files (or start with --tokenizer DIR)")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise MissingTokenizerError(self.message)

    def encode_each(self, texts) -> list[list[int]]:
        raise MissingTokenizerError(self.message)

    def apply_chat_template(self, messages: list[dict], tools: list | None = None,
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        raise MissingTokenizerError(self.message)

    def added_tokens(self) -> dict[str, int]:
        return {}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""

    def decode_stream(self, prompt_ids: list[int] | None = None) -> WindowDecoder:
        return WindowDecoder(lambda ids: "")

    def token_bytes(self, token_id: int) -> bytes:
        return b""


def has_tokenizer_files(directory: str | Path) -> bool:
    p = Path(directory)
    return (p / "tokenizer.json").is_file() or (p / "tokenizer_config.json").is_file()


def model_tokenizer(source: str) -> HFTokenizer | None:
    """The tokenizer of a model directory that has one, else None (a preset, or a directory without one)."""
    p = Path(source).expanduser()
    return HFTokenizer(p) if p.is_dir() and has_tokenizer_files(p) else None


def load_tokenizer(source: str, vocab_size: int, model_max_length: int = 4096,
                   cache_dir: str | Path | None = None) -> HFTokenizer | NoTokenizer:
    """``source``'s own tokenizer if it is a directory with one; ``NoTokenizer`` for a directory without one (text
    and chat input refused, never a made-up tokenizer); else (a preset) the byte-level preset tokenizer, written to
    (or verified in) ``cache_dir`` (default ``user_cache_dir()``) and loaded from there the same way
    (``tokenizer.name_or_path`` is that directory)."""
    p = Path(source).expanduser()
    if p.is_dir():
        return HFTokenizer(p) if has_tokenizer_files(p) else NoTokenizer(p, vocab_size)
    cache = user_cache_dir() if cache_dir is None else cache_dir
    return HFTokenizer(preset_tokenizer_dir(cache, vocab_size, model_max_length))
