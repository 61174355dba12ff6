"""The cheap length checks of the OpenAI routes: what a request can be refused by from its raw JSON, before it is
validated, rendered by the chat template or tokenized (``server/http/bodies.py`` runs them first; docs/security.md).

A token of the served tokenizer covers at most ``max_token_chars`` characters of text (its longest vocabulary
entry: bytes for a byte-level BPE, which are at least as many as the characters), so a prompt of more than
``max_model_len * max_token_chars`` characters cannot fit the context window whatever it tokenizes to: it is refused
without being tokenized (text that the tokenizer's normalizer would delete — combining marks, control characters —
is refused too; a prompt that large is not a real one). A token-id prompt or ``/detokenize`` list longer than the
window, and more chat messages (or content parts) than ``min(max_model_len, --max-chat-messages)`` — each renders
to at least one token — are refused the same way.

The retrieval server checks its text histories (``/v1/recommend``'s ``prompt`` / ``messages``) and its OpenAI beam
routes the same way, against ``--max-prompt-tokens`` instead of a context window (``PromptTokenLimits``: 413
``prompt_too_long``, the answer its check after tokenizing gives).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from grserve.inputs.refusal import ApiError

Precheck = Callable[[Any], None]  # a route's cheap checks of its raw JSON body: raises the ApiError it earns
MAX_BRACKETS = 1 << 17  # JSON arrays + objects of a body, ~1 MB of bracket-dense text: more than any context holds


@dataclass(frozen=True)
class PromptLimits:
    max_model_len: int  # the context window, in tokens
    max_token_chars: int | None  # the tokenizer's longest token in characters (None: unknown, no character bound)
    max_messages: int  # --max-chat-messages
    window: ClassVar[str] = "the context window"  # what max_model_len is, in the refusals

    @property
    def max_chars(self) -> int | None:
        return None if self.max_token_chars is None else self.max_model_len * self.max_token_chars

    @property
    def message_limit(self) -> int:
        return min(self.max_model_len, self.max_messages)

    def too_long(self, param: str, n: int, what: str) -> ApiError:
        return ApiError(400, f"this model's maximum context length is {self.max_model_len} tokens; {param} has {n} "
                             f"{what}, more than the context window can hold", param, "context_length_exceeded")

    def check_text(self, param: str, n_chars: int) -> None:
        if self.max_chars is not None and n_chars > self.max_chars:
            raise self.too_long(param, n_chars, f"characters (a token of this tokenizer holds at most "
                                                f"{self.max_token_chars}; at most {self.max_chars} fit)")

    def check_ids(self, param: str, ids: list) -> None:
        if len(ids) > self.max_model_len:
            raise self.too_long(param, len(ids), "tokens")

    def check_prompt(self, prompt: Any) -> None:
        """``prompt`` of ``/v1/completions`` / ``/tokenize``: text, a one-text list, or token ids."""
        if isinstance(prompt, str):
            self.check_text("prompt", len(prompt))
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            self.check_text("prompt", sum(len(p) for p in prompt if isinstance(p, str)))
        elif isinstance(prompt, list):
            self.check_ids("prompt", prompt)

    def check_messages(self, messages: Any) -> None:
        """Chat ``messages``: their number, their content parts, the characters of their content."""
        if not isinstance(messages, list):
            return
        limit = self.message_limit
        if len(messages) > limit:
            raise ApiError(400, f"messages: {len(messages)} messages, more than the limit of {limit} (at most "
                                f"{self.window} of {self.max_model_len} tokens and --max-chat-messages "
                                f"{self.max_messages})", "messages", "too_many_messages")
        parts, chars = 0, 0
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                parts += len(content)
                chars += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        if parts > limit:
            raise ApiError(400, f"messages: {parts} content parts, more than the limit of {limit}", "messages",
                           "too_many_messages")
        self.check_text("messages", chars)

    # the prechecks of the LLM server's routes (on the raw JSON body; ``server/llm/app.py``'s route table)
    def completion_precheck(self, raw: Any) -> None:
        self.check_prompt(_field(raw, "prompt"))

    def chat_precheck(self, raw: Any) -> None:
        self.check_messages(_field(raw, "messages"))

    def tokenize_precheck(self, raw: Any) -> None:
        self.completion_precheck(raw)
        self.chat_precheck(raw)

    def detokenize_precheck(self, raw: Any) -> None:
        tokens = _field(raw, "tokens")
        if isinstance(tokens, list):
            self.check_ids("tokens", tokens)


def _field(raw: Any, name: str) -> Any:
    return raw.get(name) if isinstance(raw, dict) else None


@dataclass(frozen=True)
class PromptTokenLimits(PromptLimits):
    """The retrieval server's prompt limits: ``max_model_len`` is ``--max-prompt-tokens``, and a prompt past it is a
    413 ``prompt_too_long`` naming the field, as the server's check of the tokenized prompt answers."""

    window: ClassVar[str] = "--max-prompt-tokens"

    def too_long(self, param: str, n: int, what: str) -> ApiError:
        return ApiError(413, f"{param}: the prompt has {n} {what}, more than the limit of {self.max_model_len} tokens "
                             f"(--max-prompt-tokens) can hold", param, "prompt_too_long")
