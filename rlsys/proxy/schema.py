"""Request validation for the proxy's OpenAI-compatible chat-completions route.

Two layers, so every client error becomes a 400 that names the field:

1. ``ChatCompletionRequest`` (pydantic v2, strict types, unknown fields ignored as OpenAI does) checks
   shapes and ranges. ``format_validation_error`` turns pydantic's first error into
   ``"messages[2].role: Input should be ..."``.
2. ``check_request`` checks what types cannot (per-role rules, JSON in tool-call arguments, a named
   ``tool_choice`` that must be one of ``tools``, unsupported options) and ``template_messages`` /
   ``template_tools`` turn the request into what a Hugging Face chat template expects. Both raise
   ``RequestError(param, message)``.

Departures from OpenAI, on purpose: ``stream``, ``n > 1``, ``stop`` strings, ``top_logprobs > 0``
and non-text content parts are refused (400) rather than silently ignored, because the agent
would otherwise get a different behaviour than it asked for. ``tool_choice`` "required" and a
named function are accepted but not enforced (no constrained decoding): the model's own output
is returned, and the reward decides. "none" renders the prompt without tools and returns no calls.

Assistant ``tool_calls[].function.arguments`` arrive as JSON text (OpenAI's format) and are decoded
to objects for the template: Qwen2.5's template renders ``arguments | tojson``, which would
double-encode a string.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

ROLES = ("system", "user", "assistant", "tool")
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class RequestError(Exception):
    """A client error: becomes a 400 (or ``status``) with an OpenAI-style error body."""

    def __init__(self, param: str | None, message: str, status: int = 400, code: str | None = None):
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param
        self.message = message
        self.status = status
        self.code = code


def loads_json(data: bytes | str) -> Any:
    """``json.loads`` that refuses NaN/Infinity (not JSON) and text JSON cannot carry back out."""

    def reject_constant(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    return json.loads(data, parse_constant=reject_constant)


def _flatten_content(value: Any) -> Any:
    """OpenAI content: a string, or a list of ``{"type": "text", "text": str}`` parts (joined by newlines)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for i, part in enumerate(value):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ValueError(f"part {i} is not a {{'type': 'text', 'text': <string>}} part (only text is supported)")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError("must be a string, a list of text parts, or null")


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class FunctionCallIn(_Model):
    name: str
    arguments: str | dict[str, Any]  # JSON text (OpenAI); an object is accepted too


class ToolCallIn(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Model):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    _flatten = field_validator("content", mode="before")(_flatten_content)


class FunctionDef(_Model):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Model):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Model):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | NamedToolChoice, checked below
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    n: int | None = None
    stream: bool | None = None
    stop: Any = None  # only "absent" is accepted, see check_request
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        if value is None or value in ("none", "auto", "required"):
            return value
        if isinstance(value, dict):
            return NamedToolChoice.model_validate(value)
        raise ValueError('must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')


def format_validation_error(err: ValidationError) -> RequestError:
    """The first pydantic error as ``RequestError("messages[2].role", "Input should be ...")``."""
    first = err.errors(include_url=False)[0]
    param = loc_to_param(first["loc"]) or None
    msg = first["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    return RequestError(param, msg)


def loc_to_param(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def check_request(req: ChatCompletionRequest) -> None:
    """Per-request rules that types cannot express; raises ``RequestError``."""
    if req.stream:
        raise RequestError("stream", "streaming is not supported")
    if req.n is not None and req.n != 1:
        raise RequestError("n", f"only n=1 is supported, got {req.n}")
    if req.stop not in (None, "", []):
        raise RequestError("stop", "stop sequences are not supported (generation stops at end-of-turn)")
    if req.top_logprobs:
        raise RequestError("top_logprobs", "top_logprobs is not supported (use logprobs=true)")
    names = [t.function.name for t in req.tools or []]
    if len(set(names)) != len(names):
        raise RequestError("tools", f"duplicate function names in {names}")
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise RequestError(
            "tool_choice", f"function {choice.function.name!r} is not among tools {names}"
        )
    if choice in ("required",) and not names:
        raise RequestError("tool_choice", '"required" needs a non-empty tools list')
    for i, m in enumerate(req.messages):
        if m.role in ("system", "user", "tool") and m.content is None:
            raise RequestError(f"messages[{i}].content", f"required for role {m.role!r}")
        if m.role == "tool" and m.tool_call_id is None:
            raise RequestError(f"messages[{i}].tool_call_id", "required for role 'tool'")
        if m.role == "assistant" and m.content is None and not m.tool_calls:
            raise RequestError(f"messages[{i}].content", "an assistant message needs content or tool_calls")


def template_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as a chat template expects them: content always a string, tool arguments decoded."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        msg: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.role == "assistant" and m.tool_calls:
            msg["tool_calls"] = [
                {
                    "type": "function",
                    "id": tc.id,
                    "function": {
                        "name": tc.function.name,
                        "arguments": _decode_arguments(tc.function.arguments, f"messages[{i}].tool_calls[{j}]"),
                    },
                }
                for j, tc in enumerate(m.tool_calls)
            ]
        if m.role == "tool":
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def template_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """Tools for the template (None when absent or when tool_choice is "none")."""
    if not req.tools or req.tool_choice == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools]


def tool_names(req: ChatCompletionRequest) -> list[str]:
    return [t.function.name for t in req.tools or []]


def _decode_arguments(arguments: str | dict[str, Any], where: str) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        return loads_json(arguments)
    except (ValueError, RecursionError) as exc:  # json.JSONDecodeError is a ValueError
        raise RequestError(f"{where}.function.arguments", f"not valid JSON: {exc}") from exc
