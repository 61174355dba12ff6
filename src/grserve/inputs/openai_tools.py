"""Tool calling on ``/v1/chat/completions`` (issue 44 item 2): ``tools`` + ``tool_choice`` (``none`` / ``auto`` /
``required`` / a named function). The tools reach the model through its own chat template (``tools=`` as HF
passes them); the answer is parsed back into ``tool_calls`` by the server's tool-call parser:

- ``hermes`` (Qwen2.5 / Qwen3 / Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks,
  the text outside them is the content;
- ``llama3_json`` (LLaMA-3.x): the answer is one JSON object ``{"name": ..., "parameters": {...}}`` (optionally after
  ``<|python_tag|>``), or several joined by ``;``.

``required`` and a named function are enforced by a grammar (``engine/structured.py``): the answer is exactly one
call in the parser's format to one of the tools (the named one), its arguments valid against the tool's
``parameters`` schema, so it always parses. ``auto`` lets the model choose; what does not parse stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from grserve.engine.structured import StructuredSpec, json_schema_ebnf
from grserve.inputs.refusal import ApiError

PARSERS = ("hermes", "llama3_json")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolPlan:
    tools: tuple[dict[str, Any], ...]  # the request's function definitions ({"name", "description", "parameters"})
    choice: str  # "none" | "auto" | "required" | "function" (named)
    name: str | None = None  # the named function

    @property
    def parses(self) -> bool:
        return self.choice != "none" and bool(self.tools)


def _bad(field: str, message: str) -> ApiError:
    return ApiError(400, f"{field}: {message}", field, "invalid_value")


def tool_plan(tools: list[dict[str, Any]] | None, tool_choice: Any) -> ToolPlan | None:
    """Validate ``tools`` / ``tool_choice`` (400 naming the field); None when there are no tools."""
    fns: list[dict[str, Any]] = []
    for i, t in enumerate(tools or []):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(f, dict):
            raise _bad(f"tools[{i}]", "a tool is {'type': 'function', 'function': {'name', 'parameters'}}")
        if not isinstance(f.get("name"), str) or not f["name"]:
            raise _bad(f"tools[{i}].function.name", "required: a non-empty string")
        params = f.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise _bad(f"tools[{i}].function.parameters", "must be a JSON schema object")
        fns.append({"name": f["name"], "description": f.get("description"), "parameters": params})
    names = [f["name"] for f in fns]
    choice, name = "auto" if fns else "none", None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise _bad("tool_choice", "must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                                      "{'name': ...}}")
        choice = tool_choice
    elif isinstance(tool_choice, dict):
        f = tool_choice.get("function")
        if tool_choice.get("type") != "function" or not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise _bad("tool_choice", "a named tool choice is {'type': 'function', 'function': {'name': ...}}")
        choice, name = "function", f["name"]
        if name not in names:
            raise _bad("tool_choice.function.name", f"no tool named {name!r} in tools")
    elif tool_choice is not None:
        raise _bad("tool_choice", "must be a string or an object")
    if choice in ("required", "function") and not fns:
        raise _bad("tool_choice", f"'{tool_choice if isinstance(tool_choice, str) else 'function'}' needs tools")
    if not fns:
        return None
    return ToolPlan(tuple(fns), choice, name)


def _call_schema(fns: list[dict[str, Any]], args_key: str) -> dict[str, Any]:
    alts = [{"type": "object", "additionalProperties": False, "required": ["name", args_key],
             "properties": {"name": {"const": f["name"]}, args_key: f["parameters"]}} for f in fns]
    return alts[0] if len(alts) == 1 else {"anyOf": alts}


def tool_spec(plan: ToolPlan | None, parser: str) -> StructuredSpec | None:
    """The grammar that enforces ``required`` / a named function (None for ``auto`` / ``none``): exactly one call
    in the parser's format."""
    if plan is None or plan.choice not in ("required", "function"):
        return None
    fns = [f for f in plan.tools if plan.choice == "required" or f["name"] == plan.name]
    if parser == "llama3_json":
        return StructuredSpec("json_schema", json.dumps(_call_schema(fns, "parameters")))
    body = json_schema_ebnf(json.dumps(_call_schema(fns, "arguments")), "call_json")
    return StructuredSpec("grammar", 'root ::= "<tool_call>\\n" call_json "\\n</tool_call>"\n' + body)


def _call(name: str, args: Any) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}}


def parse_tool_calls(text: str, parser: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of an answer; what does not parse as a call stays in the content."""
    calls: list[dict[str, Any]] = []
    if parser == "hermes":
        def take(m: re.Match) -> str:
            try:
                obj = json.loads(m.group(1))
            except ValueError:
                return m.group(0)
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return m.group(0)
            calls.append(_call(obj["name"], obj.get("arguments", {})))
            return ""
        rest = _HERMES.sub(take, text).strip()
        return (rest or None) if calls else text, calls
    body = text.strip().removeprefix("<|python_tag|>").strip()
    objs: list[Any] = []
    for parts in ([body], body.split(";")) if body.startswith("{") else ():
        try:
            objs = [json.loads(p) for p in parts]
            break
        except ValueError:
            objs = []
    if objs and all(isinstance(o, dict) and isinstance(o.get("name"), str) for o in objs):
        return None, [_call(o["name"], o.get("parameters", o.get("arguments", {}))) for o in objs]
    return text, []
