"""Tokenizers for the LLM API: an HF ``tokenizer.json`` when the model directory has one, else a byte tokenizer.

``ByteTokenizer`` (documented fallback, no download needed): id 0 = <pad>, 1 = <bos>, 2 = <eos>, and byte b is
id b + 3 (ids 3…258). Encoding is UTF-8 bytes + 3, with <bos> prepended. Decoding maps any id ≥ 3 to the byte
(id − 3) mod 256 — so a random-weight preset, which emits ids anywhere in its vocabulary, still produces text —
and decodes with UTF-8 ``errors="replace"``. Specials decode to nothing.

Chat prompts are rendered with a minimal template: ``"<|role|>\\n" + content + "\\n"`` per message, then
``"<|assistant|>\\n"`` (an HF tokenizer's own chat template is used when it has one).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable


class ByteTokenizer:
    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2
    offset = 3

    def __init__(self, vocab_size: int = 259):
        if vocab_size < 259:
            raise ValueError("the byte tokenizer needs a vocabulary of at least 259 ids")
        self.vocab_size = vocab_size

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = [b + self.offset for b in text.encode("utf-8")]
        return [self.bos_token_id] + ids if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        data = bytes((i - self.offset) % 256 for i in ids if i >= self.offset)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict]) -> str:
        return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


class HFTokenizer:
    """Wraps a ``tokenizers.Tokenizer`` from ``tokenizer.json`` (+ ``tokenizer_config.json`` for specials)."""

    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer

        d = Path(model_dir)
        self.tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        cfg = {}
        if (d / "tokenizer_config.json").is_file():
            cfg = json.loads((d / "tokenizer_config.json").read_text())
        self.chat_template = cfg.get("chat_template")

        def special(name: str) -> int | None:
            v = cfg.get(name)
            if isinstance(v, dict):
                v = v.get("content")
            return self.tok.token_to_id(v) if isinstance(v, str) else None

        self.eos_token_id = special("eos_token")
        self.bos_token_id = special("bos_token")
        self.vocab_size = self.tok.get_vocab_size()

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_token_id] if add_bos and self.bos_token_id is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict]) -> str:
        if self.chat_template:
            try:
                import jinja2

                return jinja2.Template(self.chat_template).render(messages=messages, add_generation_prompt=True)
            except Exception:  # a template we cannot render: fall back to the minimal one
                pass
        return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


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


def load_tokenizer(source: str, vocab_size: int):
    """HF tokenizer if ``source`` is a directory with tokenizer.json, else the byte tokenizer."""
    p = Path(source)
    if p.is_dir() and (p / "tokenizer.json").is_file():
        return HFTokenizer(p)
    return ByteTokenizer(vocab_size)
