"""Tool-call parsing: Hermes blocks, unclosed blocks, bare and fenced JSON, malformed strings,
adversarial input (never raises, linear time) and a render -> parse round trip."""
from __future__ import annotations

import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlsys.proxy.toolcalls import (
    ParseResult,
    ToolCall,
    ToolCallError,
    parse_tool_calls,
    to_openai_tool_calls,
)

TOOLS = ["choose_square"]


def tagged(payload: str) -> str:
    return f"<tool_call>\n{payload}\n</tool_call>"


def square_call(square) -> str:
    return json.dumps({"name": "choose_square", "arguments": {"square": square}})


def only_call(result: ParseResult) -> ToolCall:
    assert result.errors == [], result.errors
    assert len(result.calls) == 1, result.calls
    return result.calls[0]


def only_error(result: ParseResult) -> ToolCallError:
    assert result.calls == [], result.calls
    assert len(result.errors) == 1, result.errors
    return result.errors[0]


# ---------------------------------------------------------------- Hermes blocks


def test_well_formed_tagged_call():
    text = tagged(square_call(5))
    result = parse_tool_calls(text, TOOLS)
    assert only_call(result) == ToolCall("choose_square", {"square": 5}, text)
    assert result.content == ""


def test_text_around_a_tagged_call_stays_content():
    block = tagged(square_call(3))
    result = parse_tool_calls(f"I will take the corner.\n{block}\nGood luck!", TOOLS)
    assert only_call(result).raw == block
    assert result.content == "I will take the corner.\n\nGood luck!"


def test_two_calls_come_back_in_order():
    text = f"first {tagged(square_call(1))} then <tool_call>{square_call(9)}</tool_call>"
    result = parse_tool_calls(text, TOOLS)
    assert [call.arguments["square"] for call in result.calls] == [1, 9]
    assert result.errors == []
    assert result.content == "first  then"


def test_closing_tag_inside_a_json_string_does_not_end_the_block():
    payload = json.dumps({"name": "note", "arguments": {"text": "a </tool_call> b {"}})
    result = parse_tool_calls(tagged(payload))
    assert only_call(result).arguments == {"text": "a </tool_call> b {"}


def test_fence_inside_a_tagged_block_is_tolerated():
    text = f"<tool_call>\n```json\n{square_call(4)}\n```\n</tool_call>"
    result = parse_tool_calls(text, TOOLS)
    assert only_call(result).raw == text
    assert result.content == ""


# ---------------------------------------------------------------- unclosed and truncated blocks


def test_unclosed_block_with_complete_json_is_a_call():
    text = f"<tool_call>\n{square_call(7)}"
    result = parse_tool_calls(text, TOOLS)
    assert only_call(result) == ToolCall("choose_square", {"square": 7}, text)
    assert result.content == ""


def test_unclosed_block_followed_by_prose_keeps_the_prose():
    result = parse_tool_calls(f"<tool_call>{square_call(7)} that is my move", TOOLS)
    assert only_call(result).arguments == {"square": 7}
    assert result.content == "that is my move"


def test_unclosed_block_followed_by_another_block():
    text = f"<tool_call>{square_call(1)}\n<tool_call>{square_call(2)}</tool_call>"
    result = parse_tool_calls(text, TOOLS)
    assert [call.arguments["square"] for call in result.calls] == [1, 2]
    assert result.errors == []


@pytest.mark.parametrize("cut", [1, 10, 30, 45, 52])
def test_truncated_json_in_a_block_is_invalid_json_and_stays_content(cut):
    text = "<tool_call>\n" + square_call(5)[:cut]
    result = parse_tool_calls(text, TOOLS)
    assert only_error(result).kind == "invalid_json"
    assert result.errors[0].raw == text
    assert result.content == text


@pytest.mark.parametrize(
    "body",
    ["", "   ", "{'name': 'choose_square', 'arguments': {'square': 5}}", '{"name": "choose_square",}'],
)
def test_closed_block_with_unparsable_json_is_invalid_json(body):
    text = f"before <tool_call>{body}</tool_call> after"
    result = parse_tool_calls(text, TOOLS)
    assert only_error(result).kind == "invalid_json"
    assert result.content == text


def test_extra_text_before_the_closing_tag_is_invalid_json():
    result = parse_tool_calls(f"<tool_call>{square_call(5)} oops</tool_call>", TOOLS)
    assert only_error(result).kind == "invalid_json"


def test_empty_tag_at_the_end_is_invalid_json():
    result = parse_tool_calls("Let me think. <tool_call>\n", TOOLS)
    assert only_error(result).kind == "invalid_json"
    assert result.content == "Let me think. <tool_call>"


# ---------------------------------------------------------------- bare and fenced JSON


def test_bare_call_as_qwen_coder_answers():
    text = '{"name": "choose_square", "arguments": {"square": 2}}'
    result = parse_tool_calls(text, TOOLS)
    assert only_call(result) == ToolCall("choose_square", {"square": 2}, text)
    assert result.content == ""


def test_fenced_bare_call_loses_its_fence():
    call_text = square_call(2)
    result = parse_tool_calls(f"Here is my move:\n```json\n{call_text}\n```\nDone.", TOOLS)
    assert only_call(result).raw == call_text
    assert result.content == "Here is my move:\n\nDone."


def test_fence_holding_two_calls_is_removed_with_both():
    result = parse_tool_calls(f"```json\n{square_call(1)}\n{square_call(2)}\n```", TOOLS)
    assert [call.arguments["square"] for call in result.calls] == [1, 2]
    assert result.content == ""


def test_fence_left_open_at_the_end_is_removed():
    result = parse_tool_calls(f"```json\n{square_call(6)}\n", TOOLS)
    assert only_call(result).arguments == {"square": 6}
    assert result.content == ""


def test_fence_with_other_text_inside_is_kept():
    result = parse_tool_calls(f"```\nmy move: {square_call(6)}\n```", TOOLS)
    assert only_call(result).arguments == {"square": 6}
    assert result.content == "```\nmy move: \n```"


def test_bare_call_then_stray_closing_tag_after_a_prefilled_tag():
    text = square_call(8) + "\n</tool_call>"
    result = parse_tool_calls(text, TOOLS)
    assert only_call(result).raw == text
    assert result.content == ""


def test_truncated_bare_call_is_invalid_json():
    text = 'Move: {"name": "choose_square", "arguments": {"square": 5}'
    result = parse_tool_calls(text, TOOLS)
    assert only_error(result).kind == "invalid_json"
    assert result.content == text


def test_truncated_bare_call_does_not_turn_its_arguments_into_a_call():
    text = '{"name": "outer", "arguments": {"name": "inner", "arguments": {}}'
    result = parse_tool_calls(text)
    assert only_error(result).kind == "invalid_json"


def test_call_after_a_broken_call_is_still_found():
    text = '{"name": "choose_square", "arguments": {"square": 5}\n' + square_call(6)
    result = parse_tool_calls(text, TOOLS)
    assert [error.kind for error in result.errors] == ["invalid_json"]
    assert [call.arguments for call in result.calls] == [{"square": 6}]


def test_call_inside_stray_prose_braces_is_found():
    result = parse_tool_calls("{ I think " + square_call(5) + " }", TOOLS)
    assert only_call(result).arguments == {"square": 5}
    assert result.content == "{ I think  }"


@pytest.mark.parametrize(
    "text",
    ['The board is {"a": 1}.', '{"board": "XO.X.O...", "turn": "X"}', "{not json at all}", "{}", "a } b { c"],
)
def test_json_or_braces_in_prose_that_are_not_calls(text):
    assert parse_tool_calls(text, TOOLS) == ParseResult(content=text.strip(), calls=[], errors=[])


def test_bare_object_with_unknown_name_is_an_unknown_tool_attempt():
    text = '{"name": "pick_square", "arguments": {"square": 5}}'
    result = parse_tool_calls(text, TOOLS)
    assert only_error(result).kind == "unknown_tool"
    assert result.content == text


# ---------------------------------------------------------------- names, arguments, values


def test_wrong_name_in_a_block_is_unknown_tool():
    text = tagged('{"name": "choose_sqare", "arguments": {"square": 5}}')
    result = parse_tool_calls(text, TOOLS)
    assert only_error(result).kind == "unknown_tool"
    assert result.content == text


def test_any_name_is_accepted_without_tool_names():
    assert only_call(parse_tool_calls(tagged('{"name": "anything", "arguments": {}}'))).name == "anything"


def test_empty_tool_names_makes_every_name_unknown():
    assert only_error(parse_tool_calls(tagged(square_call(5)), [])).kind == "unknown_tool"


@pytest.mark.parametrize(
    "payload",
    ['{"arguments": {"square": 5}}', '{"name": "", "arguments": {}}', '{"name": 5, "arguments": {}}'],
)
def test_missing_or_unusable_name_is_missing_name(payload):
    assert only_error(parse_tool_calls(tagged(payload), TOOLS)).kind == "missing_name"


@pytest.mark.parametrize("payload", ["[1, 2]", '"choose_square"', "5", "null"])
def test_non_object_in_a_block_is_not_an_object(payload):
    assert only_error(parse_tool_calls(tagged(payload), TOOLS)).kind == "not_an_object"


@pytest.mark.parametrize(
    "arguments",
    [[5], 5, "five", '"{\\"square\\": 5}"', "[5]", '{"square": 5} extra', None],
)
def test_arguments_that_are_not_an_object_are_bad_arguments(arguments):
    payload = json.dumps({"name": "choose_square", "arguments": arguments})
    assert only_error(parse_tool_calls(tagged(payload), TOOLS)).kind == "bad_arguments"


def test_arguments_as_a_json_string_are_decoded():
    payload = json.dumps({"name": "choose_square", "arguments": json.dumps({"square": 5})})
    assert only_call(parse_tool_calls(tagged(payload), TOOLS)).arguments == {"square": 5}


def test_parameters_is_a_synonym_of_arguments():
    payload = '{"name": "choose_square", "parameters": {"square": 4}}'
    assert only_call(parse_tool_calls(payload, TOOLS)).arguments == {"square": 4}
    assert only_call(parse_tool_calls(tagged(payload), TOOLS)).arguments == {"square": 4}


def test_missing_arguments_mean_no_arguments():
    assert only_call(parse_tool_calls(tagged('{"name": "resign"}'))).arguments == {}


@pytest.mark.parametrize("square", ["5", 0, 10, -3, 2.5, True])
def test_argument_values_are_returned_as_is(square):
    # Range and type are the reward's job; the parser only checks the call's shape.
    arguments = only_call(parse_tool_calls(tagged(square_call(square)), TOOLS)).arguments
    assert arguments == {"square": square} and type(arguments["square"]) is type(square)


def test_nested_braces_and_braces_inside_strings():
    arguments = {
        "note": 'a } tricky { "string" \\ with }}} braces',
        "nested": {"deep": {"list": [{"x": "}"}]}},
    }
    payload = json.dumps({"name": "annotate", "arguments": arguments})
    for text in (tagged(payload), f"prose {payload} prose", f"<tool_call>{payload}"):
        assert only_call(parse_tool_calls(text)).arguments == arguments, text


@pytest.mark.parametrize(
    "payload",
    ['{"name": "f", "arguments": {"x": NaN}}', '{"name": "f", "arguments": {"x": 1' + "9" * 5000 + "}}"],
)
def test_values_python_json_would_choke_on_are_invalid_json(payload):
    # NaN cannot be written back as JSON; a 5000-digit integer raises ValueError inside json.
    assert only_error(parse_tool_calls(tagged(payload))).kind == "invalid_json"


@pytest.mark.parametrize("length", [4070, 4080, 4085, 4090, 4095, 4100, 20000])
def test_long_calls_across_the_decode_window(length):
    # Blocks are decoded in growing slices; calls longer than the first slice must still parse.
    arguments = {"text": "\u00e9\\\"" * (length // 3)}
    payload = json.dumps({"name": "write", "arguments": arguments})
    assert only_call(parse_tool_calls(tagged(payload))).arguments == arguments
    assert only_call(parse_tool_calls(f"<tool_call>{payload}")).arguments == arguments


# ---------------------------------------------------------------- input types


def test_empty_string_and_none_give_an_empty_result():
    assert parse_tool_calls("") == ParseResult(content="", calls=[], errors=[])
    assert parse_tool_calls(None) == ParseResult(content="", calls=[], errors=[])


@pytest.mark.parametrize("value", [b"<tool_call>{}</tool_call>", 5, ["text"]])
def test_non_string_input_is_a_type_error(value):
    with pytest.raises(TypeError, match="expects str or None"):
        parse_tool_calls(value)


# ---------------------------------------------------------------- OpenAI format


def test_to_openai_tool_calls_shape_and_deterministic_ids():
    calls = parse_tool_calls(tagged(square_call(5)) + tagged(square_call(5))).calls
    openai_calls = to_openai_tool_calls(calls)
    assert [call["type"] for call in openai_calls] == ["function", "function"]
    assert [call["function"]["name"] for call in openai_calls] == ["choose_square"] * 2
    assert all(json.loads(call["function"]["arguments"]) == {"square": 5} for call in openai_calls)
    ids = [call["id"] for call in openai_calls]
    assert ids[0].startswith("call_0_") and ids[1].startswith("call_1_") and len(set(ids)) == 2
    assert to_openai_tool_calls(calls) == openai_calls
    assert to_openai_tool_calls(calls, id_prefix="chatcmpl-7-")[0]["id"].startswith("chatcmpl-7-0_")


# ---------------------------------------------------------------- properties


_PIECES = ["{", "}", '"', "\\", "<tool_call>", "</tool_call>", ":", ",", "[", "]", "```", " ", "\n",
           '"name"', '"arguments"', '"choose_square"', "5", "x"]
_ADVERSARIAL_TEXT = st.lists(st.sampled_from(_PIECES), max_size=60).map("".join)


_ERROR_KINDS = {"invalid_json", "not_an_object", "missing_name", "bad_arguments", "unknown_tool"}


def _check_invariants(text: str, result: ParseResult) -> None:
    assert isinstance(result.content, str)
    for call in result.calls:
        assert call.raw in text and isinstance(call.arguments, dict) and call.name.strip()
    for error in result.errors:
        assert error.kind in _ERROR_KINDS
        assert error.raw in text


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=200), _ADVERSARIAL_TEXT))
def test_never_raises_on_arbitrary_text(text):
    _check_invariants(text, parse_tool_calls(text))
    _check_invariants(text, parse_tool_calls(text, TOOLS))


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
_NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,30}", fullmatch=True)


@settings(max_examples=200, deadline=None)
@given(_NAMES, st.dictionaries(st.text(max_size=10), _JSON_VALUES, max_size=5), st.booleans())
def test_round_trip_render_then_parse(name, arguments, ensure_ascii):
    text = tagged(json.dumps({"name": name, "arguments": arguments}, ensure_ascii=ensure_ascii))
    result = parse_tool_calls(text, [name])
    assert result == ParseResult(content="", calls=[ToolCall(name, arguments, text)], errors=[])


# ---------------------------------------------------------------- performance


_ADVERSARIAL_200KB = {
    "open braces": "{" * 200_000,
    "brace pairs": "{}" * 100_000,
    "nested objects in arrays": '{"a":[' * 33_000,
    "nested call-like keys": '{"name":' * 25_000,
    "failing call-like objects": '{"name": x}' * 18_000,
    "empty tags": "<tool_call>" * 18_000,
    "tags with open strings": '<tool_call>{"a": "' * 11_000,
    "unterminated string": '{"' + "\\" * 200_000,
    "stray quotes": "{" + '"' * 200_000,
}


@pytest.mark.parametrize("name", list(_ADVERSARIAL_200KB))
def test_adversarial_200kb_parses_quickly(name):
    text = _ADVERSARIAL_200KB[name]
    started = time.perf_counter()
    parse_tool_calls(text, TOOLS)
    elapsed = time.perf_counter() - started
    # Linear work takes ~0.15 s at most here; quadratic work would take minutes. Generous for busy CI.
    assert elapsed < 2.0, f"{name}: {elapsed:.2f} s"


def test_many_calls_in_a_long_text_are_all_found():
    text = "\n".join(f"move {index}: {tagged(square_call(index))}" for index in range(2000))
    result = parse_tool_calls(text, TOOLS)
    assert [call.arguments["square"] for call in result.calls] == list(range(2000))
