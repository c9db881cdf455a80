"""Whole-game SFT chats, a format warm start for multi-turn play: `python -m rlsys.envs.tictactoe_game.sft_data`.

Why: the single-move SFT data (rlsys.envs.tictactoe.sft_data) never shows a tool message, and a tiny
model warm-started on it writes one good call and then garbage after O's reply (docs/results-multiturn.md).
These chats are whole games: X plays a uniformly random FREE square each turn (so the game goes on and the
model sees tool results), O answers as the item's opponent does. Random legal play teaches the protocol
and legality, not strategy: wins, draws and losses are left to RL.
"""
from __future__ import annotations

import json
import random

from rlsys.envs.datasets import sft_main
from rlsys.envs.tictactoe import game
from rlsys.envs.tictactoe_game.dataset import make_dataset
from rlsys.envs.tictactoe_game.episode import Game
from rlsys.envs.tictactoe_game.prompt import CHOOSE_SQUARE_TOOL, TOOL_NAME, first_messages
from rlsys.envs.tictactoe_game.turns import assistant_echo, tool_message


def sft_game(item: dict, rng: random.Random) -> dict:
    g = Game.start(item)
    messages = first_messages(item["start"], item.get("prompt_variant", "default"))
    while not g.over:
        square = rng.choice(game.legal_moves(g.board))
        call_id = f"call_{len(g.moves)}"
        turn = {"content": None, "tool_calls": [{"id": call_id, "name": TOOL_NAME,
                                                 "arguments": json.dumps({"square": square})}]}
        result = g.play_turn(turn)
        messages.append(assistant_echo(turn))
        if result is not None:
            messages.append(tool_message(call_id, result))
    return {"id": f"sft-{item['id']}", "messages": messages, "tools": [CHOOSE_SQUARE_TOOL]}


def make_sft_dataset(count: int, seed: int) -> list[dict]:
    rng = random.Random(f"tictactoe_game/sft/{seed}")
    return [sft_game(item, rng) for item in make_dataset(count, seed, "train")]


def main(argv: list[str] | None = None) -> int:
    return sft_main(argv, "python -m rlsys.envs.tictactoe_game.sft_data", __doc__.splitlines()[0], make_sft_dataset,
                    512, "whole-game chats")


if __name__ == "__main__":
    raise SystemExit(main())
