"""Whole-game items: a start board with X to move, an opponent, and the seed its choices hash.

Item (one JSONL line):
    {"id": "tttg-train-00000", "seed": int, "start": <9 chars, X to move, game not over>,
     "opponent": "random" | "minimax", "blunder": float in [0, 1], "prompt_variant": str}

- start: the empty board, or (one item in three) the board after one random X and one random O move,
  so the policy does not only ever see the empty board.
- opponent: minimax with blunder 0.0 (perfect: a draw is the best X can get), 0.25 or 0.5, or random.
- seed: what the opponent's choices hash (opponent.py). Train seeds are even and held-out seeds odd, so
  the two splits never share an (opponent behaviour, item) pair, whatever the counts.
- prompt_variant: "default" in train; the held-out split cycles through the single-move env's prompt
  perturbations ('grid_alt', 'system_reworded', 'shuffled_system', 'tool_renamed') and "default".

The same (count, seed, split) gives the same bytes. Shipped files (configs point at them):
    python -m rlsys.envs.tictactoe_game.dataset --count 512 --seed 0 --split train --out rlsys/envs/tictactoe_game/data/train.jsonl
    python -m rlsys.envs.tictactoe_game.dataset --count 64 --seed 0 --split heldout --out rlsys/envs/tictactoe_game/data/heldout.jsonl
"""
from __future__ import annotations

import random
from pathlib import Path

from rlsys.envs.datasets import check_item_keys, jsonl_lines, seeded_items, write_main
from rlsys.envs.tictactoe import game
from rlsys.envs.tictactoe_game.opponent import OPPONENTS
from rlsys.envs.tictactoe_game.prompt import VARIANTS

ITEM_KEYS = ("id", "seed", "start", "opponent", "blunder", "prompt_variant")
DATA_DIR = Path(__file__).with_name("data")
# (opponent, blunder) drawn uniformly per item
OPPONENT_MIX = (("minimax", 0.0), ("minimax", 0.25), ("minimax", 0.5), ("random", 1.0))


def make_item(index: int, rng: random.Random, split: str) -> dict:
    board = game.EMPTY * 9
    if rng.randrange(3) == 0:  # one random opening pair
        board = game.apply_move(board, rng.choice(game.legal_moves(board)), "X")
        board = game.apply_move(board, rng.choice(game.legal_moves(board)), "O")
    opponent, blunder = rng.choice(OPPONENT_MIX)
    seed = 2 * rng.randrange(2**30) + (1 if split == "heldout" else 0)
    variant = "default" if split == "train" else VARIANTS[index % len(VARIANTS)]
    return {"id": f"tttg-{split}-{index:05d}", "seed": seed, "start": board, "opponent": opponent,
            "blunder": blunder, "prompt_variant": variant}


def make_dataset(count: int, seed: int, split: str = "train") -> list[dict]:
    return seeded_items(make_item, "tictactoe_game", count, seed, split)


def validate_item(item: object) -> None:
    """Raise ValueError saying what is wrong if `item` is not a whole-game item."""
    check_item_keys(item, ITEM_KEYS)
    board = item["start"]
    game.validate_board(board)
    if game.to_move(board) != "X" or game.is_terminal(board):
        raise ValueError(f"item {item['id']!r}: start {board!r} is not a running game with X to move")
    if item["opponent"] not in OPPONENTS:
        raise ValueError(f"item {item['id']!r}: opponent {item['opponent']!r} not in {OPPONENTS}")
    blunder = item["blunder"]
    if isinstance(blunder, bool) or not isinstance(blunder, (int, float)) or not 0.0 <= blunder <= 1.0:
        raise ValueError(f"item {item['id']!r}: blunder must be a number in [0, 1], got {blunder!r}")
    if type(item["seed"]) is not int:
        raise ValueError(f"item {item['id']!r}: seed must be an int, got {item['seed']!r}")
    if item["prompt_variant"] not in VARIANTS:
        raise ValueError(f"item {item['id']!r}: prompt_variant {item['prompt_variant']!r} not in {VARIANTS}")


def to_jsonl(items: list[dict]) -> str:
    return jsonl_lines(items, ITEM_KEYS)


def main(argv: list[str] | None = None) -> int:
    return write_main(argv, "python -m rlsys.envs.tictactoe_game.dataset",
                      "Write whole-game tic-tac-toe items as JSONL.", make_dataset, ITEM_KEYS, "games")


if __name__ == "__main__":
    raise SystemExit(main())
