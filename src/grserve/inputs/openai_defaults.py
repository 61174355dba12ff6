"""OpenAI parameters sent at their defaults: the one rule every OpenAI route of every grserve server applies.

OpenAI clients (the ``openai`` SDK, LangChain, LiteLLM, ...) send parameters they were never asked to set, at their
default or as ``null``: ``"logprobs": false``, ``"stop": null``, ``"frequency_penalty": 0``, ``"response_format":
{"type": "text"}``. Such a parameter asks for nothing, so it is accepted on every route:

- a top-level ``null`` is the parameter left out (its default applies; a required one is then missing);
- a parameter the route does not implement is accepted when it is exactly its OpenAI default (``NEUTRAL``; a bool
  matches only a bool, so ``"frequency_penalty": false`` is not 0) and dropped before validation; any other value
  is a 400 naming it (``unsupported_parameter``), because the route cannot honour it.

``neutral_body(raw, fields)`` applies both to a raw request body; the request models call it before validating
(``openai_schemas.SamplingRequest``, ``beam_schemas.BeamRequest``).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from grserve.inputs.refusal import ApiError

# OpenAI's (and vLLM's) parameters that ask for nothing at these values
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "repetition_penalty": (1,),
    "min_p": (0,),
    "min_tokens": (0,),
    "stop": ([],),
    "stop_token_ids": ([],),
    "logit_bias": ({},),
    "top_logprobs": (0,),
    "echo": (False,),
    "ignore_eos": (False,),
    "response_format": ({"type": "text"},),
    "tools": ([],),
    "tool_choice": ("none", "auto"),  # with no tools, "auto" calls none
    "parallel_tool_calls": (True, False),  # with no tools there is nothing to call in parallel
    "functions": ([],),
    "function_call": ("none", "auto"),
    "service_tier": ("auto", "default"),
    "store": (False,),
    "modalities": (["text"],),
    "suffix": ("",),
    "priority": ("online",),
}


def same(a: Any, b: Any) -> bool:
    """JSON equality where a bool equals only a bool (``False == 0`` in Python, not in JSON)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return isinstance(a, (int, float)) and isinstance(b, (int, float)) and a == b


def is_neutral(name: str, value: Any) -> bool:
    """``value`` asks for nothing: ``null``, or the parameter's OpenAI default."""
    if value is None:
        return True
    return any(same(value, d) for d in NEUTRAL.get(name, ()))


def neutral_body(raw: Any, fields: Collection[str]) -> Any:
    """``raw`` without its top-level ``null`` values and without the parameters outside ``fields`` (the route's own)
    that are at their default; a parameter of ``NEUTRAL`` outside ``fields`` at another value is a 400 naming it.
    Anything else (an unknown name) is left for the model to refuse."""
    if not isinstance(raw, dict):
        return raw
    out = {}
    for name, value in raw.items():
        if value is None:
            continue
        if name not in fields and name in NEUTRAL:
            if is_neutral(name, value):
                continue
            raise ApiError(400, f"'{name}' is not supported on this route: it accepts only its default "
                                f"({_shown(NEUTRAL[name])}) or null", name, "unsupported_parameter")
        out[name] = value
    return out


def _shown(values: tuple[Any, ...]) -> str:
    import json

    return " or ".join(json.dumps(v) for v in values)
