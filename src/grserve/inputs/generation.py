"""What an OpenAI generation request means, below HTTP: text → token ids (a model without tokenizer files is a 400
naming the field), the context window's bound on ``max_tokens``, and the engine's ``SamplingParams`` of each of its
``n`` choices (token ids checked against the vocabulary, choice i > 0 seeded by a stable mix of the request's seed).
The LLM server's routes (``server/llm/``) convert through these."""

from __future__ import annotations

from typing import Any

from grserve.engine.sampling import SamplingParams, mix64
from grserve.engine.structured import StructuredSpec
from grserve.engine.tokenizer import MissingTokenizerError
from grserve.inputs.openai_schemas import SamplingRequest
from grserve.inputs.refusal import ApiError, token_ids

DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI
DEFAULT_CHAT_MAX_TOKENS = 256  # /v1/chat/completions without max_tokens: at most this, at most what fits


def encode(tokenizer: Any, text: str, field: str, **kwargs: Any) -> list[int]:
    """Text → token ids; a model directory without tokenizer files is a 400 naming the field (never a made-up
    tokenizer)."""
    try:
        return tokenizer.encode(text, **kwargs)
    except MissingTokenizerError as exc:
        raise ApiError(400, str(exc), field, "no_tokenizer") from None


def choice_seed(seed: int | None, i: int) -> int | None:
    """Choice 0 uses the request's seed; choice i > 0 a stable mix of (seed, i)."""
    return seed if seed is None or i == 0 else mix64(seed, i) >> 1


def sampling_params(body: SamplingRequest, max_tokens: int, vocab_size: int, i: int = 0,
                    extra_eos: tuple[int, ...] = (), seed: int | None = None,
                    structured: StructuredSpec | None = None) -> SamplingParams:
    """The engine's sampling parameters of choice ``i`` (token ids checked against the vocabulary: 400);
    ``extra_eos`` (the model's other end-of-sequence ids) stop like EOS unless ``ignore_eos``; ``seed`` the
    request's seed (default ``body.seed``)."""
    bias = tuple((int(k), float(v)) for k, v in (body.logit_bias or {}).items())
    for t, _ in bias:
        if t >= vocab_size:
            raise ApiError(400, f"logit_bias: token {t} is out of range [0, {vocab_size})", "logit_bias",
                           "out_of_range")
    stop_ids = tuple(token_ids(body.stop_token_ids, vocab_size, "stop_token_ids").tolist()) \
        if body.stop_token_ids else ()
    if not body.ignore_eos:
        stop_ids += tuple(t for t in extra_eos if t not in stop_ids and t < vocab_size)
    if body.min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens ({body.min_tokens}) is more than max_tokens ({max_tokens})", "min_tokens",
                       "invalid_value")
    return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                          top_k=max(body.top_k or 0, 0), min_p=body.min_p,
                          seed=choice_seed(body.seed if seed is None else seed, i),
                          stop=body.stops(), stop_token_ids=stop_ids, ignore_eos=body.ignore_eos,
                          min_tokens=body.min_tokens, presence_penalty=body.presence_penalty,
                          frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
                          logit_bias=bias, logprobs=body.logprobs_k(),
                          structured=structured or body.structured_spec())


def fitting_max_tokens(body: SamplingRequest, n_prompt: int, max_tokens: int | None, max_model_len: int) -> int:
    """The request's ``max_tokens`` (a chat without one: what fits, at most ``DEFAULT_CHAT_MAX_TOKENS``); 400
    ``context_length_exceeded`` when the prompt and it do not fit the context window."""
    if max_tokens is None:
        max_tokens = min(DEFAULT_CHAT_MAX_TOKENS, max_model_len - n_prompt)
    if max_tokens < 1 or n_prompt + max_tokens > max_model_len:
        raise ApiError(400, f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                            f"{n_prompt} and max_tokens is {max(max_tokens, 1)}",
                       "max_tokens" if body.requested_max_tokens() else "messages", "context_length_exceeded")
    return max_tokens
