"""Request validation for the proxy's OpenAI-compatible chat-completions route.

Two layers, so every client error becomes a 400 that names the field:

1. ``ChatCompletionRequest`` (pydantic v2, strict types, unknown fields ignored as OpenAI does) checks
   shapes and ranges. ``format_validation_error`` turns pydantic's first error into
   ``"messages[2].role: Input should be ..."``.
2. ``check_request`` checks what types cannot (per-role rules, JSON in tool-call arguments, a named
   ``tool_choice`` that must be one of ``tools``, unsupported options) and ``template_messages`` /
   ``template_tools`` turn the request into what a Hugging Face chat template expects. Both raise
   ``RequestError(param, message)``.

Every top-level field is either honoured or refused with a 400 naming it, never silently ignored (an agent
would otherwise get a different behaviour than it asked for):

- honoured: ``model``, ``messages``, ``tools``, ``tool_choice``, ``max_tokens`` / ``max_completion_tokens``,
  ``temperature`` (below 1e-5 it samples greedily, as vLLM does), ``top_p``, ``seed``, ``stop`` (up to 4
  non-empty strings; the text ends before the first one, the sampled ids keep the token that completed it),
  ``frequency_penalty``, ``presence_penalty``, ``logit_bias`` (token id -> [-100, 100]), ``logprobs``,
  ``parallel_tool_calls`` true (every parsed call is returned), ``n`` 1, ``stream`` (server-sent events after
  generation, streaming.py), ``stream_options`` with ``stream`` true (``include_usage``; ``include_obfuscation``
  false), ``top_logprobs`` 0;
- accepted as metadata only (no effect on the completion): ``user``, ``metadata``, ``store``;
- refused: ``n`` > 1, ``top_logprobs`` > 0, ``stream_options`` without ``stream`` true or with
  ``include_obfuscation`` true, ``response_format`` other
  than ``{"type": "text"}``, ``parallel_tool_calls`` false, the deprecated ``functions`` / ``function_call``
  (use ``tools`` / ``tool_choice``), non-text content parts, and any field not listed here.

The ``developer`` role (OpenAI's newer name for system) is rendered as ``system``. ``tool_choice``
"required" and a named function are accepted but not enforced (no constrained decoding): the model's own
output is returned, and the reward decides. "none" renders the prompt without tools and returns no calls.
Nested objects (messages, tool calls) ignore unknown keys, as OpenAI does: agents send back the assistant
message as returned, with response-only keys such as ``refusal`` or ``annotations``.

Assistant ``tool_calls[].function.arguments`` arrive as JSON text (OpenAI's format) and are decoded
to objects for the template: Qwen2.5's template renders ``arguments | tojson``, which would
double-encode a string.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP_STRINGS = 4  # OpenAI's limit
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
    role: Literal["system", "developer", "user", "assistant", "tool"]
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


class StreamOptions(_Model):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # false only: the proxy adds no obfuscation field


class ChatCompletionRequest(_Model):
    model_config = ConfigDict(extra="forbid", strict=True)  # an unknown field is a 400, not ignored

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
    stop: str | list[str] | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # token id (as JSON object keys are: text) -> bias
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    parallel_tool_calls: bool | None = None
    # refused unless absent (check_request): typed loosely so that the 400 says why, not what type to send
    response_format: Any = None
    stream_options: StreamOptions | None = None
    functions: Any = None
    function_call: Any = None
    # metadata only: accepted, no effect on the completion
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None

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
    if first["type"] == "extra_forbidden":
        msg = "unknown or unsupported field; refused rather than silently ignored (see rlsys/proxy/schema.py)"
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
    if req.n is not None and req.n != 1:
        raise RequestError("n", f"only n=1 is supported, got {req.n}")
    stop_strings(req)
    logit_bias(req)
    if req.top_logprobs:
        raise RequestError("top_logprobs", "top_logprobs is not supported (use logprobs=true)")
    if req.stream_options is not None and not req.stream:
        raise RequestError("stream_options", "only allowed when stream is true")
    if req.stream_options is not None and req.stream_options.include_obfuscation:
        raise RequestError("stream_options.include_obfuscation", "obfuscation is not supported")
    if req.response_format is not None and req.response_format != {"type": "text"}:
        raise RequestError("response_format", 'only {"type": "text"} is supported (no constrained decoding)')
    if req.parallel_tool_calls is False:
        raise RequestError("parallel_tool_calls", "false is not supported: every call the model makes is returned")
    for name in ("functions", "function_call"):
        if getattr(req, name) is not None:
            raise RequestError(name, "deprecated by OpenAI and not supported; use tools and tool_choice")
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
        if m.role in ("system", "developer", "user", "tool") and m.content is None:
            raise RequestError(f"messages[{i}].content", f"required for role {m.role!r}")
        if m.role == "tool" and m.tool_call_id is None:
            raise RequestError(f"messages[{i}].tool_call_id", "required for role 'tool'")
        if m.role == "assistant" and m.content is None and not m.tool_calls:
            raise RequestError(f"messages[{i}].content", "an assistant message needs content or tool_calls")


def template_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as a chat template expects them: content always a string, tool arguments decoded."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        # "developer" is OpenAI's newer name for system; chat templates know only "system"
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.content or ""}
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


def stop_strings(req: ChatCompletionRequest) -> tuple[str, ...]:
    """The request's stop strings (``""`` and ``[]`` mean none, as before stop strings were supported)."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if stop == [""]:
        return ()
    if len(stop) > MAX_STOP_STRINGS:
        raise RequestError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    if any(not s for s in stop):
        raise RequestError("stop", "stop strings must be non-empty")
    return tuple(stop)


def logit_bias(req: ChatCompletionRequest, vocab_size: int | None = None) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted (token id, bias) pairs; keys must be token ids (below ``vocab_size`` when given)."""
    pairs = []
    for key, bias in (req.logit_bias or {}).items():
        if not (key.isascii() and key.isdigit()) or (vocab_size is not None and int(key) >= vocab_size):
            bound = f" below {vocab_size}" if vocab_size is not None else ""
            raise RequestError("logit_bias", f"key {key[:40]!r} is not a token id{bound}")
        if not -100 <= bias <= 100:
            raise RequestError("logit_bias", f"the bias of token {key} is {bias}, not in [-100, 100]")
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


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
