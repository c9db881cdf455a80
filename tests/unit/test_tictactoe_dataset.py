"""Tic-tac-toe dataset: the board pool, deterministic sampling, held-out exclusion, and load-time validation."""
from __future__ import annotations

import itertools
import json

import pytest

from rlsys.envs.tictactoe import dataset, game


def _reachable_x_to_move_by_play() -> set[str]:
    """Breadth-first play from the empty board, written independently of dataset.all_boards."""
    frontier = {"." * 9}
    found: set[str] = set()
    for ply in range(9):
        next_frontier = set()
        for board in frontier:
            if game.winner(board) is not None or "." not in board:
                continue
            if ply % 2 == 0:
                found.add(board)
            mark = "X" if ply % 2 == 0 else "O"
            next_frontier.update(board[:i] + mark + board[i + 1 :] for i in range(9) if board[i] == ".")
        frontier = next_frontier
    return found


def test_all_boards_is_the_2423_reachable_non_terminal_x_to_move_boards():
    boards = dataset.all_boards()
    assert len(boards) == 2423
    assert boards == sorted(boards)
    assert set(boards) == _reachable_x_to_move_by_play()


def test_all_boards_equals_count_consistent_boards_without_a_winner():
    # Cross-check: with equal counts and no line, every ordering of the moves is legal play.
    by_counts = {
        "".join(cells)
        for cells in itertools.product("XO.", repeat=9)
        if cells.count("X") == cells.count("O")
        and not any(cells[a] != "." and cells[a] == cells[b] == cells[c] for a, b, c in game.LINES)
    }
    assert set(dataset.all_boards()) == by_counts


def test_make_dataset_items_are_valid_distinct_and_x_to_move():
    items = dataset.make_dataset(2048, seed=2026)
    assert len(items) == 2048
    assert len({item["board"] for item in items}) == 2048
    assert len({item["id"] for item in items}) == 2048
    for item in items:
        assert list(item) == ["id", "board", "legal_moves", "best_moves"]
        assert item["id"] == "ttt-" + item["board"]
        assert game.to_move(item["board"]) == "X"
        assert not game.is_terminal(item["board"])
        assert item["legal_moves"] == game.legal_moves(item["board"])
        assert set(item["best_moves"]) <= set(item["legal_moves"]) and item["best_moves"]


def test_make_dataset_is_deterministic_per_seed():
    assert dataset.make_dataset(100, seed=1) == dataset.make_dataset(100, seed=1)
    assert dataset.make_dataset(100, seed=1) != dataset.make_dataset(100, seed=2)


def test_make_dataset_exclude_gives_disjoint_boards():
    train = dataset.make_dataset(2048, seed=2026)
    train_boards = {item["board"] for item in train}
    heldout = dataset.make_dataset(375, seed=7, exclude=train_boards)
    assert {item["board"] for item in heldout}.isdisjoint(train_boards)
    assert len(heldout) == 375 == 2423 - 2048


def test_make_dataset_rejects_counts_beyond_what_is_available():
    train_boards = {item["board"] for item in dataset.make_dataset(2048, seed=2026)}
    with pytest.raises(ValueError, match="asked for 376 boards but only 375 are available"):
        dataset.make_dataset(376, seed=7, exclude=train_boards)
    with pytest.raises(ValueError, match="only 2423"):
        dataset.make_dataset(2424, seed=0)
    with pytest.raises(ValueError, match="positive"):
        dataset.make_dataset(0, seed=0)


def test_cli_same_seed_same_bytes_and_exclude(tmp_path, capsys):
    first, second, heldout = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "heldout.jsonl"
    dataset.main(["--count", "300", "--seed", "2026", "--out", str(first)])
    dataset.main(["--count", "300", "--seed", "2026", "--out", str(second)])
    assert first.read_bytes() == second.read_bytes()
    assert first.read_text().count("\n") == 300

    dataset.main(["--count", "200", "--seed", "5", "--out", str(heldout), "--exclude", str(first)])
    train_boards = {item["board"] for item in dataset.load_dataset(first)}
    heldout_boards = {item["board"] for item in dataset.load_dataset(heldout)}
    assert len(heldout_boards) == 200 and heldout_boards.isdisjoint(train_boards)
    assert "wrote 200 boards" in capsys.readouterr().out


def test_cli_count_too_large_exits_with_message(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        dataset.main(["--count", "5000", "--seed", "1", "--out", str(tmp_path / "x.jsonl")])
    assert exit_info.value.code == 2
    assert "asked for 5000 boards but only 2423 are available" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()


def test_load_dataset_round_trip(tmp_path):
    items = dataset.make_dataset(50, seed=3)
    path = tmp_path / "d.jsonl"
    dataset.write_dataset(items, path)
    assert dataset.load_dataset(path) == items


GOOD = dataset.make_item("XO..O...X")


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "must be a JSON object"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "best_moves"}), "missing key"),
        (json.dumps({**GOOD, "id": 7}), "'id' must be a non-empty string"),
        (json.dumps({**GOOD, "board": "XO..O..X"}), "length 8"),
        (json.dumps({**GOOD, "board": "XO..Q...X"}), "characters"),
        (json.dumps({**GOOD, "board": "XXXOO...."}), "not X to move"),
        (json.dumps({**GOOD, "board": "XXXOOO..."}), "both X and O"),
        (json.dumps({**GOOD, "board": "OOOXX.X.."}), "terminal"),
        (json.dumps({**GOOD, "legal_moves": [2, 3]}), "legal_moves is"),
        (json.dumps({**GOOD, "legal_moves": [3.0, 4, 6, 7, 8]}), "list of ints"),
        (json.dumps({**GOOD, "best_moves": [3]}), "best_moves is"),
        (json.dumps({**GOOD, "best_moves": "8"}), "list of ints"),
        ("", "blank line"),
    ],
)
def test_load_dataset_errors_name_file_and_line(tmp_path, bad_line, message):
    path = tmp_path / "bad.jsonl"
    good_line = json.dumps(dataset.make_item("." * 9))
    path.write_text(good_line + "\n" + bad_line + "\n" + json.dumps(GOOD) + "\n")
    with pytest.raises(ValueError, match=message) as error_info:
        dataset.load_dataset(path)
    assert f"{path}:2:" in str(error_info.value)


def test_load_dataset_rejects_repeated_board(tmp_path):
    path = tmp_path / "dup.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps({**GOOD, "id": "other"}) + "\n")
    with pytest.raises(ValueError, match=f"{path}:2: board .* repeats line 1"):
        dataset.load_dataset(path)
