"""The tic-tac-toe board dataset: every reachable mid-game board with X to move, sampled by seed.

Why a fixed, enumerated pool: there are exactly 2,423 boards that can be reached from the empty
board by legal play, where the game is not over and X is to move. Sampling from that sorted pool
with `random.Random(seed)` makes a split a pure function of (count, seed, exclude), so the same
command writes the same bytes on every machine, and `--exclude` gives a held-out split that is
disjoint from training by construction.

Item (one JSONL line, see docs/CONTRACTS.md):
    {"id": "ttt-<board>", "board": <9 chars>, "legal_moves": [int, ...], "best_moves": [int, ...]}
The id is "ttt-" + the board string: stable across seeds and splits (the same board always has the
same id), so ids from different files can be compared directly.

Command line:
    python -m rlsys.envs.tictactoe.dataset --count 2048 --seed 2026 --out train.jsonl
    python -m rlsys.envs.tictactoe.dataset --count 256 --seed 7 --out heldout.jsonl --exclude train.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import random
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

from rlsys.envs.tictactoe import game

ITEM_KEYS = ("id", "board", "legal_moves", "best_moves")
ID_PREFIX = "ttt-"
EMPTY_BOARD = game.EMPTY * 9


@lru_cache(maxsize=1)
def _all_boards_cached() -> tuple[str, ...]:
    """Walk the game tree from the empty board; keep non-terminal boards with X to move."""
    seen: set[str] = set()
    kept: set[str] = set()
    stack = [EMPTY_BOARD]
    while stack:
        board = stack.pop()
        if board in seen:
            continue
        seen.add(board)
        if game.is_terminal(board):
            continue  # the game is over: no item, and nothing is reachable through it
        player = game.to_move(board)
        if player == "X":
            kept.add(board)
        stack.extend(game.apply_move(board, square, player) for square in game.legal_moves(board))
    return tuple(sorted(kept))


def all_boards() -> list[str]:
    """All 2,423 reachable, non-terminal boards with X to move, sorted."""
    return list(_all_boards_cached())


def make_item(board: str) -> dict:
    """The dataset item for `board` (which must be a reachable, non-terminal board with X to move)."""
    return {
        "id": ID_PREFIX + board,
        "board": board,
        "legal_moves": game.legal_moves(board),
        "best_moves": game.best_moves(board),
    }


def make_dataset(count: int, seed: int, exclude: Iterable[str] = ()) -> list[dict]:
    """`count` distinct items sampled with `random.Random(seed)` from all boards not in `exclude`.

    `exclude` holds board strings (e.g. the boards of a training split). Raises ValueError if
    `count` is not positive or exceeds the boards available after exclusion.
    """
    excluded = set(exclude)
    for board in excluded:
        game.validate_board(board)
    available = [board for board in _all_boards_cached() if board not in excluded]
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be a positive int, got {count!r}")
    if count > len(available):
        total = len(_all_boards_cached())
        raise ValueError(
            f"asked for {count} boards but only {len(available)} are available "
            f"({total} in all, {total - len(available)} excluded)"
        )
    chosen = random.Random(seed).sample(available, count)
    return [make_item(board) for board in chosen]


def _is_int_list(value: object) -> bool:
    """True for a list of ints; bools and floats like 3.0 are rejected (they compare equal to ints)."""
    return isinstance(value, list) and all(type(element) is int for element in value)


def validate_item(item: object) -> None:
    """Raise ValueError saying what is wrong if `item` is not a valid dataset item.

    Extra keys are allowed (tools may annotate items); the four contract keys must be present and
    consistent with the board.
    """
    if not isinstance(item, dict):
        raise ValueError(f"item must be a JSON object, got {type(item).__name__}")
    missing = [key for key in ITEM_KEYS if key not in item]
    if missing:
        raise ValueError(f"missing key(s) {missing}")
    if not isinstance(item["id"], str) or not item["id"]:
        raise ValueError(f"'id' must be a non-empty string, got {item['id']!r}")
    board = item["board"]
    game.validate_board(board)
    if game.to_move(board) != "X":
        raise ValueError(f"board {board!r}: not X to move")
    if game.is_terminal(board):
        raise ValueError(f"board {board!r} is terminal (game over)")
    for key in ("legal_moves", "best_moves"):
        if not _is_int_list(item[key]):
            raise ValueError(f"{key!r} must be a list of ints, got {item[key]!r}")
    expected_legal = game.legal_moves(board)
    if item["legal_moves"] != expected_legal:
        raise ValueError(f"board {board!r}: legal_moves is {item['legal_moves']!r}, expected {expected_legal}")
    expected_best = game.best_moves(board)
    if item["best_moves"] != expected_best:
        raise ValueError(f"board {board!r}: best_moves is {item['best_moves']!r}, expected {expected_best}")


def load_dataset(path: str | os.PathLike) -> list[dict]:
    """Read and validate a JSONL dataset; raise ValueError naming `file:line` and the problem.

    Every line must be a valid item (see `validate_item`); boards and ids must be distinct.
    Blank lines are errors too, except that the file may end with a newline.
    """
    items: list[dict] = []
    first_line_of_board: dict[str, int] = {}
    first_line_of_id: dict[str, int] = {}
    text = Path(path).read_text(encoding="utf-8")
    for line_number, line in enumerate(text.splitlines(), start=1):
        where = f"{path}:{line_number}"
        if not line.strip():
            raise ValueError(f"{where}: blank line")
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not JSON ({error})") from error
        try:
            validate_item(item)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from error
        if item["board"] in first_line_of_board:
            raise ValueError(f"{where}: board {item['board']!r} repeats line {first_line_of_board[item['board']]}")
        if item["id"] in first_line_of_id:
            raise ValueError(f"{where}: id {item['id']!r} repeats line {first_line_of_id[item['id']]}")
        first_line_of_board[item["board"]] = line_number
        first_line_of_id[item["id"]] = line_number
        items.append(item)
    return items


def write_dataset(items: list[dict], path: str | os.PathLike) -> None:
    """Write items as JSONL (one compact object per line, keys in contract order), via a temp file + rename."""
    path = Path(path)
    lines = [json.dumps({key: item[key] for key in ITEM_KEYS}) + "\n" for item in items]
    temp_path = path.with_name(path.name + ".tmp")
    temp_path.write_text("".join(lines), encoding="utf-8")
    temp_path.replace(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rlsys.envs.tictactoe.dataset",
        description="Write distinct mid-game tic-tac-toe boards (X to move) as JSONL.",
    )
    parser.add_argument("--count", type=int, required=True, help="number of boards (at most 2,423 minus excluded)")
    parser.add_argument("--seed", type=int, required=True, help="sampling seed; same seed -> same file")
    parser.add_argument("--out", type=Path, required=True, help="output JSONL path")
    parser.add_argument("--exclude", type=Path, help="JSONL dataset whose boards must not appear (held-out split)")
    args = parser.parse_args(argv)

    excluded_boards = [item["board"] for item in load_dataset(args.exclude)] if args.exclude else []
    try:
        items = make_dataset(args.count, args.seed, exclude=excluded_boards)
    except ValueError as error:
        parser.error(str(error))  # exits with status 2 and the message
    write_dataset(items, args.out)
    print(f"wrote {len(items)} boards to {args.out}")


if __name__ == "__main__":
    main()
