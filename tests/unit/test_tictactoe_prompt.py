"""Tic-tac-toe prompt rendering, its perturbed variants, and the agent's request/response handling (fake client)."""
from __future__ import annotations

import asyncio
import copy
import json
from types import SimpleNamespace

import pytest

from rlsys.envs.tictactoe import prompt
from rlsys.envs.tictactoe.agent import agent

BOARD = "X.O.X...."


def test_render_board_shows_numbers_for_free_squares():
    assert prompt.render_board(BOARD) == "X|2|O\n4|X|6\n7|8|9"
    assert prompt.render_board("." * 9) == "1|2|3\n4|5|6\n7|8|9"


def test_render_board_alt():
    assert prompt.render_board_alt(BOARD) == "X 2 O / 4 X 6 / 7 8 9"


def test_render_board_rejects_bad_board():
    with pytest.raises(ValueError, match="board"):
        prompt.render_board("XO")


def test_messages_for_is_system_then_user():
    messages = prompt.messages_for(BOARD)
    assert [message["role"] for message in messages] == ["system", "user"]
    assert messages[0]["content"] == prompt.SYSTEM_PROMPT
    assert "choose_square" in prompt.SYSTEM_PROMPT
    assert prompt.render_board(BOARD) in messages[1]["content"]


def test_tool_schema():
    function = prompt.CHOOSE_SQUARE_TOOL["function"]
    assert prompt.CHOOSE_SQUARE_TOOL["type"] == "function"
    assert function["name"] == "choose_square"
    assert function["parameters"]["properties"]["square"]["type"] == "integer"
    assert (function["parameters"]["properties"]["square"]["minimum"],
            function["parameters"]["properties"]["square"]["maximum"]) == (1, 9)
    assert function["parameters"]["required"] == ["square"]
    assert function["parameters"]["additionalProperties"] is False
    json.dumps(prompt.CHOOSE_SQUARE_TOOL)  # must be JSON-serialisable for the request body


@pytest.mark.parametrize("variant", prompt.PERTURBATIONS)
def test_each_perturbation_changes_exactly_one_message(variant):
    default = prompt.messages_for(BOARD)
    perturbed = prompt.perturbed_messages(BOARD, variant)
    assert [message["role"] for message in perturbed] == ["system", "user"]
    changed = [index for index in range(2) if perturbed[index]["content"] != default[index]["content"]]
    assert changed == ([1] if variant == "grid_alt" else [0])


def test_shuffled_system_has_the_same_sentences():
    shuffled = prompt.perturbed_messages(BOARD, "shuffled_system")[0]["content"]
    assert shuffled != prompt.SYSTEM_PROMPT
    assert len(shuffled) == len(prompt.SYSTEM_PROMPT)
    for sentence in ("You play tic-tac-toe as X.", "Call choose_square with the number of a free square."):
        assert sentence in shuffled


def test_tool_renamed_does_not_name_the_tool():
    assert "choose_square" not in prompt.perturbed_messages(BOARD, "tool_renamed")[0]["content"]


def test_unknown_variant_raises():
    with pytest.raises(ValueError, match="unknown prompt variant 'bogus'"):
        prompt.perturbed_messages(BOARD, "bogus")


# ---------------------------------------------------------------- agent, against a fake client


class _FakeCompletions:
    def __init__(self, response):
        self.response = response
        self.requests: list[dict] = []

    async def create(self, **kwargs):
        self.requests.append(copy.deepcopy(kwargs))
        return self.response


def _fake_client(content, tool_calls, finish_reason):
    message = SimpleNamespace(content=content, tool_calls=tool_calls)
    response = SimpleNamespace(choices=[SimpleNamespace(message=message, finish_reason=finish_reason)])
    completions = _FakeCompletions(response)
    return SimpleNamespace(chat=SimpleNamespace(completions=completions)), completions


def _tool_call(name, arguments):
    return SimpleNamespace(id="call_0", type="function", function=SimpleNamespace(name=name, arguments=arguments))


def test_agent_sends_one_forced_tool_call_request_and_returns_the_contract_dict():
    client, completions = _fake_client(
        None, [_tool_call("choose_square", '{"square": 6}'), _tool_call("choose_square", '{"square": 2}')], "tool_calls"
    )
    output = asyncio.run(agent({"id": "ttt-" + BOARD, "board": BOARD}, client, "tiny"))
    assert completions.requests == [
        {
            "model": "tiny",
            "messages": prompt.messages_for(BOARD),
            "tools": [prompt.CHOOSE_SQUARE_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "choose_square"}},
        }
    ]
    assert output == {
        "content": None,
        "tool_calls": [
            {"name": "choose_square", "arguments": '{"square": 6}'},
            {"name": "choose_square", "arguments": '{"square": 2}'},
        ],
        "finish_reason": "tool_calls",
    }
    json.dumps(output)


def test_agent_without_tool_calls_returns_an_empty_list():
    client, _ = _fake_client("I pick 5", None, "stop")
    output = asyncio.run(agent({"board": BOARD}, client, "tiny"))
    assert output == {"content": "I pick 5", "tool_calls": [], "finish_reason": "stop"}
