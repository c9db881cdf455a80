"""Parse model output text into OpenAI-style tool calls.

The proxy runs this on every completion: what it finds becomes the ChatCompletion's `tool_calls`,
the rest stays `content`. It is deliberately more lenient than vLLM's `hermes` parser, because the
small models rlsys starts from rarely emit well-formed Hermes blocks (shared/models/README.md):
Qwen2.5-0.5B answers with a bare `{"name": ..., "arguments": {...}}`, often inside a ```json fence,
and with a prefilled `<tool_call>` it stops without `</tool_call>`. A strict parser finds no call in
any sample, every reward is -1 and GRPO has no signal.

Accepted forms, in order of the text:
- Hermes/Qwen blocks `<tool_call>{json}</tool_call>`, one or several, with text around them; a
  ```json fence inside the block is tolerated.
- Unclosed blocks `<tool_call>{json}` (end of text, prose, or another `<tool_call>` follows): the
  JSON value after the tag is read up to its end. Not an error when that JSON is complete.
- Bare JSON objects outside blocks that look like a call (a "name", "arguments" or "parameters"
  key), optionally inside a ``` fence (removed with the call) and optionally followed by a stray
  `</tool_call>` (the prefilled-tag case; removed with the call). Other JSON objects in prose,
  e.g. {"a": 1}, are content and not errors.
- "arguments" as a JSON-encoded string is decoded; "parameters" is a synonym of "arguments"
  ("arguments" wins when both are present); a call with neither has arguments {}.

Argument values are not validated against any schema (square "5" stays the string "5", square 10
stays 10): the reward decides. Only the shape is checked: arguments must be a JSON object.

Error kinds (ToolCallError.kind); failed text stays in `content`:
- 'invalid_json'  a <tool_call> block whose JSON does not parse (truncated, single quotes, empty,
                  extra text before </tool_call>, nesting too deep), or a bare object that starts
                  like a call (`{"name": ...`, `{"arguments": ...`, `{"parameters": ...`) but
                  does not parse (e.g. truncated at the end of the text).
- 'not_an_object' a <tool_call> block holding a JSON value that is not an object (list, string...).
- 'missing_name'  no "name", or "name" not a non-blank string.
- 'bad_arguments' arguments (or parameters) neither an object nor a string decoding to an object.
- 'unknown_tool'  tool_names was given and the name is not among them (an empty collection makes
                  every name unknown). Checked before the arguments.

Input: None is treated as ""; any other non-str raises TypeError. For any str the parser never
raises. Cost is linear in the text length: the bare-object search is one brace/string-aware scan,
and JSON decoding is only tried at objects nested at most _MAX_SCAN_DEPTH braces deep, so inputs
like 200 KB of '{' or '{"a":[' parse in well under a second.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import re
from collections.abc import Collection
from dataclasses import dataclass, field

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

# Objects nested deeper than this (counting braces from the start of a stretch of prose) are not
# tried as calls. Real calls sit at depth 0 or 1; the cap bounds the work on adversarial nesting.
_MAX_SCAN_DEPTH = 8

_WHITESPACE = re.compile(r"\s*")
_FENCE_MARK = re.compile(r"```")
_FENCE_OPENER = re.compile(r"```[\w+.-]*[ \t]*\r?\n?\s*")
_FENCE_CLOSER = re.compile(r"\s*```")
_OBJECT_WITH_KEY = re.compile(r"\{\s*\"")
_CALL_LIKE_START = re.compile(r"\{\s*\"(?:name|arguments|parameters)\"\s*:")
_CALL_KEYS = {"name", "arguments", "parameters"}  # a bare object with one of these is a call attempt
_CLOSE_AFTER = re.compile(r"\s*" + re.escape(TOOL_CALL_CLOSE))
# Outside JSON strings the scanner stops at braces and quotes; inside, at the quote, a backslash,
# or a raw control character (invalid in a JSON string: the scanner resyncs there, json fails there).
_SCAN_STRUCTURAL = re.compile(r"[{}\"]")
_SCAN_IN_STRING = re.compile(r"[\"\\\x00-\x1f]")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    raw: str  # the exact source text of the call: the whole <tool_call> block, or the bare object


@dataclass(frozen=True)
class ToolCallError:
    kind: str  # one of the kinds in the module docstring
    message: str
    raw: str  # the source text of the failed attempt (it stays in content)


@dataclass(frozen=True)
class ParseResult:
    content: str  # the text minus parsed calls (with their tags and fences), stripped
    calls: list[ToolCall]
    errors: list[ToolCallError]


def _reject_nonfinite_constant(constant: str) -> float:
    raise ValueError(f"{constant} is not valid JSON")


# NaN/Infinity are not JSON: json.dumps would later write them back and OpenAI clients would fail.
_DECODER = json.JSONDecoder(parse_constant=_reject_nonfinite_constant)


@dataclass(frozen=True)
class _Decoded:
    value: object | None  # the decoded JSON value when ok
    end: int  # index after the value when ok; where decoding failed otherwise
    ok: bool
    message: str = ""
    out_of_input: bool = False  # failed only because the slice ended: more text might parse


# Slices ending this close to a decode error may have caused it (a cut `\uXXXX`, `tru`, `1e`).
_CUT_MARGIN = 16
_FIRST_WINDOW = 4096


def _decode_json_slice(text: str, start: int, stop: int) -> _Decoded:
    """Decode one JSON value from text[start:stop]; failures come back as data, never raised.

    Decoding a slice, not the whole text, matters for speed: json.JSONDecodeError counts the
    newlines before the error position, so thousands of failed attempts deep in a long text
    would cost quadratic time.
    """
    piece = text[start:stop]
    try:
        value, end = _DECODER.raw_decode(piece)
    except json.JSONDecodeError as error:
        cut = error.msg.startswith("Unterminated string") or error.pos + _CUT_MARGIN >= len(piece)
        return _Decoded(None, start + error.pos, False, error.msg, out_of_input=cut and stop < len(text))
    except RecursionError:
        return _Decoded(None, stop, False, "JSON nested too deeply")
    except ValueError as error:  # NaN/Infinity, or an integer past Python's digit limit
        return _Decoded(None, stop, False, str(error))
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if is_number and end == len(piece) and stop < len(text):  # its digits may go on past the cut
        return _Decoded(None, stop, False, "value reaches the end of the slice", out_of_input=True)
    return _Decoded(value, start + end, True)


def _decode_json_at(text: str, start: int) -> _Decoded:
    """Decode one JSON value at text[start] of unknown length: slices growing 4x until decisive."""
    window = _FIRST_WINDOW
    while True:
        decoded = _decode_json_slice(text, start, min(len(text), start + window))
        if not decoded.out_of_input:
            return decoded
        window *= 4


def _arguments_from(call: dict) -> dict | str:
    """The call's arguments as a dict, or a message saying why they are unusable."""
    key = "arguments" if "arguments" in call else "parameters" if "parameters" in call else None
    if key is None:
        return {}
    arguments = call[key]
    if isinstance(arguments, str):
        leading = _WHITESPACE.match(arguments).end()
        decoded = _decode_json_at(arguments, leading)
        if not decoded.ok:
            return f"{key} is a string that is not JSON: {decoded.message}"
        if arguments[decoded.end:].strip():
            return f"{key} is a string with extra text after its JSON"
        arguments = decoded.value
    if not isinstance(arguments, dict):
        return f"{key} must be a JSON object, got {type(arguments).__name__}"
    return arguments


def _call_from_value(
    value: object, raw: str, tool_names: Collection[str] | None
) -> ToolCall | ToolCallError:
    """Check a decoded JSON value's shape and turn it into a call or an error."""
    if not isinstance(value, dict):
        return ToolCallError("not_an_object", f"expected a JSON object, got {type(value).__name__}", raw)
    name = value.get("name")
    if not isinstance(name, str) or not name.strip():
        return ToolCallError("missing_name", "the call needs a non-blank string 'name'", raw)
    if tool_names is not None and name not in tool_names:
        return ToolCallError("unknown_tool", f"no tool named {name!r}", raw)
    arguments = _arguments_from(value)
    if isinstance(arguments, str):
        return ToolCallError("bad_arguments", arguments, raw)
    return ToolCall(name, arguments, raw)


@dataclass
class _Attempt:
    """One call attempt found in the text: [start, end) is removed from content if it succeeded."""

    start: int
    end: int
    outcome: ToolCall | ToolCallError


# ---- Phase 1: <tool_call> blocks -------------------------------------------------------------


def _tagged_attempts(text: str, tool_names: Collection[str] | None) -> list[_Attempt]:
    attempts = []
    search_from = 0
    while (open_at := text.find(TOOL_CALL_OPEN, search_from)) != -1:
        attempt = _parse_tagged_block(text, open_at, tool_names)
        attempts.append(attempt)
        search_from = attempt.end
    return attempts


def _parse_tagged_block(text: str, open_at: int, tool_names: Collection[str] | None) -> _Attempt:
    body_start = open_at + len(TOOL_CALL_OPEN)
    next_open = text.find(TOOL_CALL_OPEN, body_start)
    block_limit = len(text) if next_open == -1 else next_open
    json_start = _WHITESPACE.match(text, body_start).end()
    fence = _FENCE_OPENER.match(text, json_start)
    if fence:
        json_start = fence.end()

    decoded = _decode_json_at(text, json_start)
    if not decoded.ok:
        close_at = text.find(TOOL_CALL_CLOSE, body_start, block_limit)
        end = block_limit if close_at == -1 else close_at + len(TOOL_CALL_CLOSE)
        message = f"<tool_call> JSON does not parse: {decoded.message} (at offset {decoded.end - open_at})"
        return _Attempt(open_at, end, ToolCallError("invalid_json", message, text[open_at:end]))

    value_end = decoded.end
    if fence and (closer := _FENCE_CLOSER.match(text, value_end)):
        value_end = closer.end()
    close = _CLOSE_AFTER.match(text, value_end)
    if close:
        end = close.end()
    else:
        next_open_after = text.find(TOOL_CALL_OPEN, value_end)
        search_stop = len(text) if next_open_after == -1 else next_open_after
        later_close = text.find(TOOL_CALL_CLOSE, value_end, search_stop)
        if later_close != -1:  # closed, but with something that is not JSON before the tag
            end = later_close + len(TOOL_CALL_CLOSE)
            message = "unexpected text after the JSON value inside <tool_call>"
            return _Attempt(open_at, end, ToolCallError("invalid_json", message, text[open_at:end]))
        end = value_end  # unclosed block with complete JSON: lenient, what follows is content
    raw = text[open_at:end]
    return _Attempt(open_at, end, _call_from_value(decoded.value, raw, tool_names))


# ---- Phase 2: bare JSON objects between blocks ------------------------------------------------


@dataclass
class _Brace:
    """A '{' seen by the scanner, with the objects opened inside it (depth <= _MAX_SCAN_DEPTH)."""

    start: int
    end: int = -1  # index after the matching '}', or the end of the stretch if unclosed
    children: list[_Brace] = field(default_factory=list)


def _scan_braces(text: str, start: int, stop: int) -> list[_Brace]:
    """Match braces in text[start:stop], skipping JSON strings inside them, in one linear pass.

    Quotes only count inside braces (prose outside is ignored), and a raw control character ends a
    string, so a stray quote cannot hide the rest of the text. For valid JSON the spans agree
    exactly with json's, so decoding a span never reads past it.
    """
    roots: list[_Brace] = []
    open_stack: list[_Brace | None] = []  # None for braces deeper than the cap
    in_string = False
    position = start
    while position < stop:
        if not open_stack:
            position = text.find("{", position, stop)
            if position == -1:
                break
            mark = "{"
        elif in_string:
            match = _SCAN_IN_STRING.search(text, position, stop)
            if match is None:
                break
            position = match.start()
            if text[position] == "\\":
                position += 2  # a backslash escapes the next character
            else:  # the closing quote, or a control character that ends a broken string
                in_string = False
                position += 1
            continue
        else:
            match = _SCAN_STRUCTURAL.search(text, position, stop)
            if match is None:
                break
            position = match.start()
            mark = text[position]

        if mark == "{":
            depth = len(open_stack)
            brace = _Brace(position) if depth <= _MAX_SCAN_DEPTH else None
            if brace is not None:
                (open_stack[-1].children if open_stack else roots).append(brace)
            open_stack.append(brace)
        elif mark == "}":
            closed = open_stack.pop()
            if closed is not None:
                closed.end = position + 1
        else:
            in_string = True
        position += 1
    for unclosed in open_stack:
        if unclosed is not None:
            unclosed.end = stop
    return roots


def _bare_attempts(
    text: str, braces: list[_Brace], stop: int, tool_names: Collection[str] | None
) -> list[_Attempt]:
    """Try each brace as a call; inside one that fails, look only past where the JSON went wrong.

    Objects inside the valid prefix of a failed object are its data (e.g. the arguments of a
    truncated call), not calls of their own.
    """
    attempts = []
    for brace in braces:
        if not _OBJECT_WITH_KEY.match(text, brace.start):
            attempts += _bare_attempts(text, brace.children, stop, tool_names)
            continue
        # A valid object ends exactly at the scanner's matching brace, so that bounds the decode.
        decoded = _decode_json_slice(text, brace.start, brace.end)
        if decoded.ok:
            if isinstance(decoded.value, dict) and decoded.value.keys() & _CALL_KEYS:
                raw = text[brace.start:decoded.end]
                outcome = _call_from_value(decoded.value, raw, tool_names)
                end = decoded.end
                if isinstance(outcome, ToolCall) and (close := _CLOSE_AFTER.match(text, end, stop)):
                    end = close.end()  # `{...}</tool_call>` after a prefilled tag
                    outcome = ToolCall(outcome.name, outcome.arguments, text[brace.start:end])
                attempts.append(_Attempt(brace.start, end, outcome))
            continue  # any other valid JSON object is prose data: not an attempt, not searched
        if _CALL_LIKE_START.match(text, brace.start):
            raw = text[brace.start:brace.end]
            message = f"call-like JSON object does not parse: {decoded.message}"
            attempts.append(_Attempt(brace.start, brace.end, ToolCallError("invalid_json", message, raw)))
        failed_at = decoded.end if not decoded.ok else brace.end
        later_children = [child for child in brace.children if child.start >= failed_at]
        attempts += _bare_attempts(text, later_children, stop, tool_names)
    return attempts


def _gaps_between(attempts: list[_Attempt], text_length: int) -> list[tuple[int, int]]:
    gaps, gap_start = [], 0
    for attempt in attempts:
        gaps.append((gap_start, attempt.start))
        gap_start = attempt.end
    gaps.append((gap_start, text_length))
    return [(start, stop) for start, stop in gaps if start < stop]


# ---- Phase 3: content = text minus successful calls and the fences around them -----------------


def _removed_spans(text: str, calls: list[_Attempt]) -> list[tuple[int, int]]:
    """Spans to cut from content: each call, widened to a ``` fence that holds only calls."""
    fence_marks = [match.start() for match in _FENCE_MARK.finditer(text)]
    spans: list[tuple[int, int]] = []
    index = 0
    while index < len(calls):
        last = index  # group calls separated only by whitespace: one fence may hold several
        while last + 1 < len(calls) and not text[calls[last].end:calls[last + 1].start].strip():
            last += 1
        start, end = calls[index].start, calls[last].end
        spans.append(_widen_to_fence(text, fence_marks, start, end))
        index = last + 1
    return spans


def _widen_to_fence(text: str, fence_marks: list[int], start: int, end: int) -> tuple[int, int]:
    opener_index = bisect.bisect_left(fence_marks, start) - 1
    if opener_index < 0 or opener_index % 2 == 1:  # no fence before, or the last one closed a fence
        return start, end
    opener = _FENCE_OPENER.match(text, fence_marks[opener_index])
    if opener is None or opener.end() != start:  # the opener's pattern eats trailing whitespace
        return start, end
    closer_index = opener_index + 1
    if closer_index < len(fence_marks):
        closer_at = fence_marks[closer_index]
        if closer_at >= end and not text[end:closer_at].strip():
            return fence_marks[opener_index], closer_at + 3
        return start, end
    if not text[end:].strip():  # fence left open at the end of the output
        return fence_marks[opener_index], end
    return start, end


def _content_without(text: str, spans: list[tuple[int, int]]) -> str:
    pieces, kept_from = [], 0
    for start, end in spans:
        pieces.append(text[kept_from:start])
        kept_from = end
    pieces.append(text[kept_from:])
    return "".join(pieces).strip()


# ---- Public API -------------------------------------------------------------------------------


def parse_tool_calls(text: str | None, tool_names: Collection[str] | None = None) -> ParseResult:
    """Split model output into content, tool calls and failed call attempts (see module docstring)."""
    if text is None:
        text = ""
    if not isinstance(text, str):
        raise TypeError(f"parse_tool_calls expects str or None, got {type(text).__name__}")

    attempts = _tagged_attempts(text, tool_names)
    for gap_start, gap_stop in _gaps_between(attempts, len(text)):
        braces = _scan_braces(text, gap_start, gap_stop)
        attempts += _bare_attempts(text, braces, gap_stop, tool_names)
    attempts.sort(key=lambda attempt: attempt.start)

    successes = [attempt for attempt in attempts if isinstance(attempt.outcome, ToolCall)]
    content = _content_without(text, _removed_spans(text, successes))
    return ParseResult(
        content=content,
        calls=[attempt.outcome for attempt in successes],
        errors=[attempt.outcome for attempt in attempts if isinstance(attempt.outcome, ToolCallError)],
    )


def to_openai_tool_calls(calls: list[ToolCall], id_prefix: str = "call_") -> list[dict]:
    """OpenAI `tool_calls` entries; ids are deterministic: <prefix><index>_<8 hex of name+arguments>."""
    openai_calls = []
    for index, call in enumerate(calls):
        arguments_json = json.dumps(call.arguments)
        digest = hashlib.sha256(f"{index}\0{call.name}\0{arguments_json}".encode("utf-8", "surrogatepass"))
        openai_calls.append({
            "id": f"{id_prefix}{index}_{digest.hexdigest()[:8]}",
            "type": "function",
            "function": {"name": call.name, "arguments": arguments_json},
        })
    return openai_calls
