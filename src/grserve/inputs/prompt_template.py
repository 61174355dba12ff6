"""Item-id histories written as the model's own prompt (``--prompt-template``): for a chat- or instruction-trained GR
model (MiniOneRec, LC-Rec, OneRec) a bare run of SID tokens is not the prompt it learned from.

``--prompt-template FILE`` names a Jinja template (rendered sandboxed, undefined variables an error) whose variables
are:

- ``history``: the history's items as the model writes them (each item's SID token text, wrapped in
  ``sid_begin`` / ``sid_end`` where the layout has them), joined by ``", "``;
- ``items``: the same texts as a list (``{{ items | join(' ') }}`` for another separator);
- ``item_ids``: the catalog item ids (``history_items``; ``None`` for ``history_sids``).

``--prompt-format text`` (default): the rendered text is the prompt, encoded as ``/v1/completions`` encodes text
(special tokens added, e.g. a BOS). ``chat``: the rendered text is one user message, rendered with the model's chat
template (ready for the assistant's turn) and encoded as ``/v1/chat/completions`` encodes a chat. Either way the
beams start after the prompt (after an appended ``sid_begin`` where the layout has one), exactly as if the client had
sent that prompt. It applies to ``history_items`` and ``history_sids`` of ``/v1/recommend``, the offline API and
``grserve recommend``; an empty history stays a cold start (the popularity order). A history too long for
``--max-prompt-tokens`` once rendered loses its oldest items until it fits (``truncate`` "left"), or is a 413.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PROMPT_FORMATS = ("text", "chat")


class PromptTemplateError(ValueError):
    """The template file cannot be read or compiled (named with its line)."""


class PromptTemplate:
    def __init__(self, source: str, fmt: str = "text", name: str = "<template>") -> None:
        from jinja2 import StrictUndefined, TemplateSyntaxError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if fmt not in PROMPT_FORMATS:
            raise PromptTemplateError(f"prompt format must be one of {', '.join(PROMPT_FORMATS)}, got {fmt!r}")
        env = ImmutableSandboxedEnvironment(undefined=StrictUndefined, keep_trailing_newline=True)
        try:
            self.template = env.from_string(source)
        except TemplateSyntaxError as exc:
            raise PromptTemplateError(f"{name}: line {exc.lineno}: {exc.message}") from None
        self.fmt, self.name = fmt, name

    @classmethod
    def load(cls, path: str | Path, fmt: str = "text") -> "PromptTemplate":
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise PromptTemplateError(f"{path}: cannot read the prompt template ({type(exc).__name__})") from None
        return cls(text, fmt, str(path))

    def render(self, items: list[str], item_ids: list[int] | None = None) -> str:
        try:
            return self.template.render(history=", ".join(items), items=list(items), item_ids=item_ids)
        except Exception as exc:  # a Jinja error, the sandbox's refusals, or the template's own (1 // 0, 1 + 'a')
            raise PromptTemplateError(f"{self.name}: {exc}") from None

    def token_ids(self, tokenizer: Any, items: list[str], item_ids: list[int] | None = None) -> list[int]:
        """The prompt's token ids, as ``/v1/completions`` (text) or ``/v1/chat/completions`` (chat) encodes it."""
        text = self.render(items, item_ids)
        if self.fmt == "chat":
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
            return list(tokenizer.encode(text, add_special_tokens=False))
        return list(tokenizer.encode(text))
