"""Tic-tac-toe reward plug-in: the value of each label, malformed outputs of many kinds, random garbage."""
from __future__ import annotations

import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from rlsys.envs.tictactoe import game
from rlsys.envs.tictactoe.dataset import make_item
from rlsys.envs.tictactoe.reward import outcome, reward

# X O .      O threatens the middle column: 8 is the only optimal move; 1, 2, 5, 9 are taken.
# . O .
# . . X
ITEM = make_item("XO..O...X")
# X X .      3 wins at once.
# O O .
# . . .
WIN_ITEM = make_item("XX.OO....")

REWARD_BY_LABEL = {
    "no_tool_call": -1.0,
    "parse_error": -1.0,
    "occupied": -1.0,
    "out_of_range": -1.0,
    "legal_suboptimal": 0.0,
    "optimal": 0.8,
    "win": 1.0,
}


def _output(*tool_calls, content=None, finish_reason="tool_calls"):
    return {"content": content, "tool_calls": list(tool_calls), "finish_reason": finish_reason}


def _call(arguments, name="choose_square"):
    return {"name": name, "arguments": arguments}


def _judge(output, item=ITEM):
    record = {"item": item, "output": output}
    return outcome(record), reward(record)


def test_label_table_matches_game_outcomes():
    assert set(REWARD_BY_LABEL) == set(game.OUTCOMES)


@pytest.mark.parametrize(
    ("item", "output", "label"),
    [
        (WIN_ITEM, _output(_call('{"square": 3}')), "win"),
        (ITEM, _output(_call('{"square": 8}')), "optimal"),
        (ITEM, _output(_call('{"square": 3}')), "legal_suboptimal"),
        (ITEM, _output(_call('{"square": 5}')), "occupied"),
        (ITEM, _output(_call('{"square": 0}')), "out_of_range"),
        (ITEM, _output(_call('{"square": 10}')), "out_of_range"),
        (ITEM, _output(_call('{"square": -1}')), "out_of_range"),
        (ITEM, _output(_call('{"square": 123456789012345678901234567890}')), "out_of_range"),
        (ITEM, _output(content="I will take square 8.", finish_reason="stop"), "no_tool_call"),
        (ITEM, _output(content=None, finish_reason="length"), "no_tool_call"),
        (ITEM, _output(_call("not json")), "parse_error"),
    ],
)
def test_reward_of_each_label(item, output, label):
    assert _judge(output, item) == (label, REWARD_BY_LABEL[label])


def test_first_tool_call_counts():
    assert _judge(_output(_call('{"square": 8}'), _call('{"square": 5}'))) == ("optimal", 0.8)
    assert _judge(_output(_call('{"square": 5}'), _call('{"square": 8}'))) == ("occupied", -1.0)
    assert _judge(_output(_call("{"), _call('{"square": 8}'))) == ("parse_error", -1.0)


def test_broken_tool_call_in_content_is_a_parse_error():
    broken = '<tool_call>{"name": "choose_square", "arguments": {"square": 8</tool_call>'
    assert _judge(_output(content=broken, finish_reason="stop")) == ("parse_error", -1.0)


def test_unextracted_tool_call_in_content_is_a_parse_error():
    # A well-formed call left in the content (not delivered as a tool call) does not count as a move.
    text = '<tool_call>{"name": "choose_square", "arguments": {"square": 8}}</tool_call>'
    assert _judge(_output(content=text, finish_reason="stop")) == ("parse_error", -1.0)


@pytest.mark.parametrize(
    "output",
    [
        _output(_call('{"square": 8}', name="pick_square")),
        _output(_call('{"square": 8}', name=None)),
        _output({"arguments": '{"square": 8}'}),
        _output(_call('{"square": true}')),
        _output(_call('{"square": "8"}')),
        _output(_call('{"square": 8.0}')),
        _output(_call('{"square": null}')),
        _output(_call('{"square": [8]}')),
        _output(_call('{"square": NaN}')),
        _output(_call('{"square": 1e400}')),
        _output(_call('{"square": 8, "reason": "block"}')),
        _output(_call('{"Square": 8}')),
        _output(_call("{}")),
        _output(_call("[8]")),
        _output(_call("8")),
        _output(_call('"{\\"square\\": 8}"')),
        _output(_call("")),
        _output(_call({"square": 8})),  # arguments must be JSON text, not an object
        _output(_call(None)),
        _output(_call("[" * 100_000)),  # too deep for the JSON decoder
        _output(_call('{"square": ' + "9" * 5000 + "}")),  # past Python's int digit limit
        _output("choose_square"),
        _output(None),
        _output(["choose_square", '{"square": 8}']),
        {"content": None, "tool_calls": "choose_square(8)", "finish_reason": "stop"},
        {"content": None, "tool_calls": {"name": "choose_square", "arguments": '{"square": 8}'}},
        "choose_square(8)",
        42,
        ["tool_calls"],
    ],
)
def test_malformed_tool_calls_are_parse_errors(output):
    assert _judge(output) == ("parse_error", -1.0)


@pytest.mark.parametrize(
    "output",
    [
        None,
        {},
        {"content": None},
        {"tool_calls": None},
        {"content": 17, "tool_calls": []},
        {"content": ["a", "b"], "tool_calls": None, "finish_reason": 3},
    ],
)
def test_missing_tool_calls_are_no_tool_call(output):
    assert _judge(output) == ("no_tool_call", -1.0)


def test_record_without_output_is_no_tool_call():
    assert outcome({"item": ITEM}) == "no_tool_call"
    assert reward({"item": ITEM}) == -1.0


@pytest.mark.parametrize(
    "record",
    [
        None,
        {"output": _output(_call('{"square": 8}'))},
        {"item": {"board": "XO..O...X"}, "output": None},
        {"item": {**ITEM, "board": "XXXOO...."}, "output": None},
        {"item": {**ITEM, "best_moves": [3]}, "output": None},
    ],
)
def test_bad_item_raises_naming_it_a_data_or_framework_bug(record):
    for function in (reward, outcome):
        with pytest.raises(ValueError, match="framework bug"):
            function(record)


# ---------------------------------------------------------------- random garbage

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)
_arguments = st.one_of(
    st.text(max_size=40),
    _json_values.map(json.dumps),
    st.dictionaries(st.sampled_from(["square", "Square", "x"]), _json_values, max_size=2).map(json.dumps),
    st.integers(-20, 20).map(lambda square: json.dumps({"square": square})),
    _json_values,
)
_tool_call = st.one_of(
    st.fixed_dictionaries(
        {"name": st.one_of(st.just("choose_square"), _json_values), "arguments": _arguments},
        optional={"id": _json_values},
    ),
    _json_values,
)
_content = st.one_of(
    st.none(),
    st.text(max_size=60),
    st.text(max_size=40).map(lambda inner: f"<tool_call>{inner}</tool_call>"),
    st.text(max_size=40).map(lambda inner: f"<tool_call>{inner}"),
    _json_values,
)
_outputs = st.one_of(
    _json_values,
    st.fixed_dictionaries(
        {},
        optional={
            "content": _content,
            "tool_calls": st.one_of(st.lists(_tool_call, max_size=3), _json_values),
            "finish_reason": _json_values,
        },
    ),
)


@settings(max_examples=400, deadline=None)
@given(output=_outputs)
def test_random_outputs_never_raise_and_reward_matches_label(output):
    label, value = _judge(output)
    assert label in game.OUTCOMES
    assert value == REWARD_BY_LABEL[label]


def _is_exact_square_call(tool_call: object) -> bool:
    if not isinstance(tool_call, dict) or tool_call.get("name") != "choose_square":
        return False
    arguments = tool_call.get("arguments")
    return isinstance(arguments, str) and arguments.startswith('{"square": ') and arguments[11:-1].lstrip("-").isdigit()


@settings(max_examples=300, deadline=None)
@given(tool_calls=st.lists(_tool_call, min_size=1, max_size=3))
def test_random_first_calls_that_are_not_a_square_integer_score_minus_one(tool_calls):
    assume(not _is_exact_square_call(tool_calls[0]))  # a well-formed call is scored by the game (tested above)
    assert _judge(_output(*tool_calls)) == ("parse_error", -1.0)


def test_summarize_by_kind_counts_each_kind_against_its_own_success():
    from rlsys.envs.tictactoe.reward import summarize_by_kind

    win, block, lost, other = "XX.OO....", "X....XOO.", "...XOXOXO", "XO......."
    items = [{"board": b} for b in (win, win, win, block, block, lost, other, other)]
    outcomes = ["win", "optimal", "failed",  # an optimal non-winning move is not a taken win; a failure is a miss
                "optimal", "legal_suboptimal",  # blocked, did not block
                "legal_suboptimal",  # any legal move on a lost board
                "optimal", "occupied"]
    m = summarize_by_kind(items, outcomes)
    assert m == {"win_taken_rate": 1 / 3, "win_later_rate": 1 / 3, "win_episodes": 3.0, "block_rate": 0.5,
                 "block_episodes": 2.0, "lost_legal_rate": 1.0, "lost_episodes": 1.0, "other_optimal_rate": 0.5,
                 "other_episodes": 2.0}


def test_the_missed_wins_split_into_slower_wins_and_worse_moves():
    """`win_later_rate` counts, on boards with an immediate win only, the answers that still force a win later."""
    from rlsys.envs.tictactoe import game
    from rlsys.envs.tictactoe.reward import summarize_by_kind

    win, other = "XX..O..O.", "XO......."
    assert [game.move_outcome(win, sq) for sq in (3, 4, 6)] == ["win", "optimal", "legal_suboptimal"]
    items = [{"board": b} for b in (win, win, win, win, other)]
    m = summarize_by_kind(items, ["win", "optimal", "optimal", "legal_suboptimal", "optimal"])
    assert (m["win_taken_rate"], m["win_later_rate"], m["other_optimal_rate"]) == (0.25, 0.5, 1.0)
    assert "win_later_rate" not in summarize_by_kind([{"board": other}], ["optimal"])  # no such boards, no rate


def test_summarize_by_kind_leaves_out_the_rate_of_an_absent_kind():
    from rlsys.envs.tictactoe.reward import summarize_by_kind

    m = summarize_by_kind([{"board": "XX.OO...."}], ["win"])
    assert m["win_taken_rate"] == 1.0 and "block_rate" not in m and m["block_episodes"] == 0.0
    with pytest.raises(ValueError, match="2 items but 1 outcomes"):
        summarize_by_kind([{"board": "XX.OO...."}] * 2, ["win"])


def test_episode_metrics_name_the_one_rate_the_board_tests():
    """Training batches get the eval's split by kind: each episode reports the rate of its board's kind, 0 or 1."""
    from rlsys.envs.tictactoe.env import ENV
    from rlsys.envs.tictactoe.reward import episode_metrics

    assert ENV.episode_metrics is episode_metrics
    square = lambda n: _output(_call(json.dumps({"square": n})))  # noqa: E731
    win, block, lost, other = (make_item(b) for b in ("XX.OO....", "X....XOO.", "...XOXOXO", "XO......."))
    assert episode_metrics({"item": win, "output": square(3)}) == {"win_taken": 1.0, "win_later": 0.0}
    # any other move (6 blocks O instead of winning) and a broken call are misses
    assert episode_metrics({"item": win, "output": square(6)}) == {"win_taken": 0.0, "win_later": 0.0}
    assert episode_metrics({"item": win, "output": _output(_call("{broken"))}) == {"win_taken": 0.0, "win_later": 0.0}
    # a move that still forces a win later is a miss too, counted apart
    later = make_item("XX..O..O.")
    assert episode_metrics({"item": later, "output": square(4)}) == {"win_taken": 0.0, "win_later": 1.0}
    assert episode_metrics({"item": block, "output": square(9)}) == {"block": 1.0}
    assert episode_metrics({"item": block, "output": square(2)}) == {"block": 0.0}
    assert episode_metrics({"item": lost, "output": square(1)}) == {"lost_legal": 1.0}
    assert episode_metrics({"item": other, "output": square(2)}) == {
        "other_optimal": float(outcome({"item": other, "output": square(2)}) in ("optimal", "win"))}
    with pytest.raises(ValueError, match="invalid dataset item"):  # bad data raises, as the reward does
        episode_metrics({"item": {"board": "XXX"}, "output": square(1)})
    # the training job's eval line prints the rates of each prompt variant; the episodes' copies are not one
    from jobs.train import eval_line

    line = eval_line({"eval/rewards_mean": 0.5, "eval/win_taken_rate": 0.25, "eval/episode/win_taken": 0.25,
                      "eval/grid_alt/win_taken_rate": 0.5, "eval/grid_alt/episode/win_taken": 0.5})
    assert line == "rewards_mean 0.500 win_taken 0.250  |  grid_alt: win_taken 0.500"
