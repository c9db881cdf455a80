"""The whole-game tic-tac-toe env without a model: opponent, dataset, turn rules, reward, agent loop."""
from __future__ import annotations

import asyncio
import json

import pytest

from rlsys.envs.tictactoe import game
from rlsys.envs.tictactoe_game import dataset
from rlsys.envs.tictactoe_game.agent import agent
from rlsys.envs.tictactoe_game.episode import Game, replay, square_of
from rlsys.envs.tictactoe_game.opponent import opponent_move
from rlsys.envs.tictactoe_game.prompt import GAME_SENTENCE, TOOL_NAME, first_messages, tool_result
from rlsys.envs.tictactoe_game.reward import OUTCOMES, REWARD_BY_OUTCOME, outcome, reward, summarize
from rlsys.envs.tictactoe_game.turns import assistant_echo, turn_record

ITEM = {"id": "g", "seed": 4, "start": ".........", "opponent": "minimax", "blunder": 0.0, "prompt_variant": "default"}


def call_turn(square, *, content=None, call_id="call_0"):
    args = json.dumps({"square": square}) if not isinstance(square, str) else square
    return {"content": content, "tool_calls": [{"id": call_id, "name": TOOL_NAME, "arguments": args}],
            "finish_reason": "tool_calls", "tool_call_errors": []}


def text_turn(content, errors=()):
    return {"content": content, "tool_calls": [], "finish_reason": "stop", "tool_call_errors": list(errors)}


def play(item, policy):
    """Turn records of a game where X plays policy(board)."""
    g, turns = Game.start(item), []
    while not g.over:
        turns.append(call_turn(policy(g.board)))
        g.play_turn(turns[-1])
    return turns, g


# ---- opponent -----------------------------------------------------------------------------------


def test_opponent_is_a_pure_function_of_seed_and_board():
    board = "X........"
    assert len({opponent_move(board, "minimax", 0.5, 7) for _ in range(20)}) == 1
    replies = {opponent_move(board, "random", 1.0, seed) for seed in range(40)}
    assert len(replies) > 3 and replies <= set(game.legal_moves(board))


def test_perfect_opponent_only_plays_best_moves_and_draws_perfect_x():
    for board in ("X........", "....X....", "XX..O...."):  # O to move
        for seed in range(10):
            assert opponent_move(board, "minimax", 0.0, seed) in game.best_moves(board)
    for seed in range(8):
        _, g = play({**ITEM, "seed": seed}, lambda b: game.best_moves(b)[0])
        assert g.outcome == "draw"


def test_opponent_refuses_a_board_where_o_cannot_move():
    with pytest.raises(ValueError, match="not O to move"):
        opponent_move(".........", "minimax", 0.0, 1)
    with pytest.raises(ValueError, match="unknown opponent"):
        opponent_move("X........", "alphazero", 0.0, 1)


# ---- dataset ------------------------------------------------------------------------------------


def test_dataset_is_deterministic_valid_and_the_shipped_files_match_the_generator():
    a, b = dataset.make_dataset(50, 3), dataset.make_dataset(50, 3)
    assert a == b and a != dataset.make_dataset(50, 4)
    for item in a:
        dataset.validate_item(item)
    for split, count in (("train", 512), ("heldout", 64)):
        shipped = (dataset.DATA_DIR / f"{split}.jsonl").read_text()
        assert shipped == dataset.to_jsonl(dataset.make_dataset(count, 0, split)), f"{split}.jsonl is stale"


def test_splits_never_share_a_seed_and_heldout_uses_every_prompt_variant():
    train, held = dataset.make_dataset(512, 0, "train"), dataset.make_dataset(64, 0, "heldout")
    assert all(i["seed"] % 2 == 0 for i in train) and all(i["seed"] % 2 == 1 for i in held)
    assert {i["prompt_variant"] for i in train} == {"default"}
    assert {i["prompt_variant"] for i in held} == {"default", "grid_alt", "system_reworded", "shuffled_system",
                                                   "tool_renamed"}
    assert any(i["start"] != "........." for i in train)


@pytest.mark.parametrize("bad, match", [
    ({"start": "X........"}, "not a running game"), ({"opponent": "god"}, "opponent"),
    ({"blunder": 1.5}, "blunder"), ({"prompt_variant": "x"}, "prompt_variant"), ({"seed": "1"}, "seed"),
])
def test_validate_item_names_the_problem(bad, match):
    with pytest.raises(ValueError, match=match):
        dataset.validate_item({**ITEM, **bad})


# ---- turn rules ---------------------------------------------------------------------------------


@pytest.mark.parametrize("turn, label", [
    (text_turn("I pick the centre."), "no_tool_call"),
    (text_turn('<tool_call>\n{"name": "choose_square", "arguments": {"square": 5}\n</tool_call>',
               [{"kind": "invalid_json", "message": "..."}]), "parse_error"),
    (text_turn('<tool_call>{"name": "choose_square", "arguments": {"square": 5'), "parse_error"),  # errors not carried
    (call_turn('{"square": 5.0}'), "parse_error"), (call_turn('{"square": "5"}'), "parse_error"),
    (call_turn('{"square": true}'), "parse_error"), (call_turn('{"square": 5, "x": 1}'), "parse_error"),
    (call_turn("not json"), "parse_error"), (call_turn(0), "out_of_range"), (call_turn(10), "out_of_range"),
    ({**call_turn(5), "tool_calls": call_turn(5)["tool_calls"] * 2}, "multiple_calls"),
    ({**call_turn(5), "tool_calls": [{"id": "c", "name": "other_tool", "arguments": '{"square": 5}'}]}, "parse_error"),
])
def test_square_of_labels_every_forfeit(turn, label):
    assert square_of(turn) == label


def test_a_legal_move_gets_o_reply_and_the_new_board_as_tool_result():
    g = Game.start(ITEM)
    text = g.play_turn(call_turn(5))
    (_, o), = [m for m in g.moves if m[0] == "O"]
    assert g.board.count("X") == 1 and g.board.count("O") == 1 and not g.over
    assert text == tool_result(5, o, g.board) and text.startswith(f"You played 5. O played {o}.\n")
    assert text.endswith("\nYour move.")


def test_occupied_square_ends_the_game_and_no_turn_may_follow():
    g = Game.start(ITEM)
    g.play_turn(call_turn(5))
    taken = next(sq for _, sq in g.moves if _ == "O")
    assert g.play_turn(call_turn(taken)) is None and g.outcome == "occupied"
    with pytest.raises(ValueError, match="is over"):
        g.play_turn(call_turn(1))


# ---- reward -------------------------------------------------------------------------------------


def test_reward_table_covers_every_outcome():
    assert set(REWARD_BY_OUTCOME) == set(OUTCOMES)
    assert (REWARD_BY_OUTCOME["win"], REWARD_BY_OUTCOME["draw"], REWARD_BY_OUTCOME["loss"]) == (1.0, 0.5, -0.5)
    assert all(REWARD_BY_OUTCOME[o] == -1.0 for o in OUTCOMES if o not in ("win", "draw", "loss"))


def test_reward_replays_wins_losses_and_draws():
    weak = {**ITEM, "opponent": "random", "blunder": 1.0}
    results = {}
    for seed in range(30):
        for name, policy in (("best", lambda b: game.best_moves(b)[0]), ("worst", lambda b: game.legal_moves(b)[-1])):
            item = {**weak, "seed": seed}
            turns, g = play(item, policy)
            record = {"item": item, "output": {"turns": turns}}
            assert outcome(record) == g.outcome and reward(record) == REWARD_BY_OUTCOME[g.outcome]
            results.setdefault(g.outcome, 0)
            results[g.outcome] += 1
    assert {"win", "loss"} <= set(results)


def test_claimed_win_is_ignored_and_unfinished_or_empty_output_is_minus_one():
    turns, _ = play(ITEM, lambda b: game.best_moves(b)[0])
    forged = {"turns": turns[:1], "outcome": "win", "final_board": "XXXOO...."}
    assert outcome({"item": ITEM, "output": forged}) == "unfinished" and reward({"item": ITEM, "output": forged}) == -1.0
    for output in (None, {}, {"turns": "x"}, "text", {"turns": []}):
        assert reward({"item": ITEM, "output": output}) == -1.0
    with pytest.raises(ValueError, match="not a turn record"):
        reward({"item": ITEM, "output": {"turns": [5]}})


def test_turns_after_the_end_raise_and_a_bad_item_raises():
    with pytest.raises(ValueError, match="is over"):
        reward({"item": ITEM, "output": {"turns": [text_turn("hi"), call_turn(5)]}})
    with pytest.raises(ValueError, match="missing key"):
        reward({"item": {"id": "x"}, "output": {"turns": []}})


def test_summarize_rates():
    rates = summarize(["win", "draw", "loss", "occupied"])
    assert rates == {"win_rate": 0.25, "draw_rate": 0.25, "loss_rate": 0.25, "finished_game_rate": 0.75}


# ---- prompt and turn records --------------------------------------------------------------------


def test_prompts_reuse_the_single_move_text_and_variants_keep_the_tool_name_out_when_renamed():
    system, user = first_messages(".........")
    assert system["content"].endswith(GAME_SENTENCE) and "choose_square" in system["content"]
    assert user["content"] == "1|2|3\n4|5|6\n7|8|9\nYour move."
    assert TOOL_NAME not in first_messages(".........", "tool_renamed")[0]["content"]
    assert "Board: 1 2 3 / 4 5 6 / 7 8 9" in first_messages(".........", "grid_alt")[1]["content"]
    assert "X 2 3 / 4 O 6" in tool_result(1, 5, "X...O....", "grid_alt")


def completion(content, calls=(), ext=None):
    from openai.types.chat import ChatCompletion

    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": f"call_{i}", "type": "function", "function": {"name": TOOL_NAME, "arguments": a}}
                                 for i, a in enumerate(calls)]
    body = {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if calls else "stop"}]}
    if ext is not None:
        body["rlsys"] = ext
    return ChatCompletion.model_validate(body)


def test_turn_record_reads_the_extension_and_the_echo_returns_the_message_unchanged():
    ext = {"completion_ids": [5, 6], "prompt_ids": [1, 2], "tool_call_errors": [{"kind": "invalid_json", "message": "m"}]}
    turn = turn_record(completion(None, ['{"square":  5}'], ext), keep_prompt_ids=True)
    assert turn["completion_ids"] == [5, 6] and turn["prompt_ids"] == [1, 2]
    assert turn["tool_call_errors"] == [{"kind": "invalid_json", "message": "m"}]
    assert assistant_echo(turn) == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": TOOL_NAME, "arguments": '{"square":  5}'}}]}
    plain = turn_record(completion("  hello\n"))  # another server: no extension
    assert plain["completion_ids"] == [] and "prompt_ids" not in plain
    assert assistant_echo(plain) == {"role": "assistant", "content": "  hello\n"}


class FakeClient:
    """`client.chat.completions.create` answering from a policy over the last board seen."""

    def __init__(self, replies):
        self.replies = list(replies)
        self.requests = []
        self.chat = self.completions = self

    async def create(self, **kwargs):
        self.requests.append(json.loads(json.dumps(kwargs)))
        return self.replies.pop(0)


def test_agent_loop_echoes_each_call_and_answers_it_with_a_tool_message():
    turns, g = play(ITEM, lambda b: game.best_moves(b)[0])
    squares = [json.loads(t["tool_calls"][0]["arguments"])["square"] for t in turns]
    client = FakeClient([completion(None, [json.dumps({"square": s})]) for s in squares])
    out = asyncio.run(agent(ITEM, client, "m"))
    assert out["outcome"] == g.outcome == "draw" and len(out["turns"]) == len(squares)
    assert reward({"item": ITEM, "output": out}) == 0.5
    last = client.requests[-1]["messages"]
    assert [m["role"] for m in last] == ["system", "user"] + ["assistant", "tool"] * (len(squares) - 1)
    for i, (asst, tool) in enumerate(zip(last[2::2], last[3::2])):
        assert asst["content"] is None and asst["tool_calls"][0]["function"]["arguments"] == json.dumps({"square": squares[i]})
        assert tool["tool_call_id"] == asst["tool_calls"][0]["id"] and tool["content"].startswith(f"You played {squares[i]}.")
    assert all(r["tools"][0]["function"]["name"] == TOOL_NAME for r in client.requests)


def test_sft_games_are_legal_whole_games_that_render_as_one_prefix_extended_chat():
    from transformers import AutoTokenizer

    from rlsys.envs.tictactoe_game.sft_data import make_sft_dataset
    from rlsys.models.tiny import ensure_tiny_model
    from rlsys.sft import render_chat

    chats = make_sft_dataset(8, 0)
    assert chats == make_sft_dataset(8, 0)
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    for chat, item in zip(chats, dataset.make_dataset(8, 0)):
        turns = [{"content": None, "tool_calls": [{"id": c["id"], "name": c["function"]["name"],
                                                   "arguments": c["function"]["arguments"]} for c in m["tool_calls"]]}
                 for m in chat["messages"] if m["role"] == "assistant"]
        assert replay(item, turns).outcome in ("win", "draw", "loss")
        seg = render_chat(tokenizer, chat["messages"], chat["tools"])
        assert tokenizer.decode([t for t, m in zip(seg.input_ids, seg.loss_mask) if m]).count("<tool_call>") == len(turns)
