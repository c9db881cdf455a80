"""Tic-tac-toe rules and minimax: hand-checked positions, and an independent negamax on every dataset board."""
from __future__ import annotations

import pytest

from rlsys.envs.tictactoe import game
from rlsys.envs.tictactoe.dataset import all_boards

# ---------------------------------------------------------------- rules


def test_legal_moves_are_free_squares_ascending():
    assert game.legal_moves("X...O...X") == [2, 3, 4, 6, 7, 8]
    assert game.legal_moves("." * 9) == list(range(1, 10))


@pytest.mark.parametrize(
    ("board", "expected"),
    [
        ("XXXOO....", "X"),  # row
        ("OX.OX.O.X", "O"),  # column
        ("X.O.XO..X", "X"),  # diagonal
        ("..X.XOXO.", "X"),  # anti-diagonal
        ("XOXXOOOXX", None),  # full board, draw
        ("." * 9, None),
    ],
)
def test_winner(board, expected):
    assert game.winner(board) == expected


def test_winner_rejects_a_line_for_both_players():
    with pytest.raises(ValueError, match="both X and O"):
        game.winner("XXXOOO...")


def test_is_terminal():
    assert game.is_terminal("XXXOO....")
    assert game.is_terminal("XOXXOOOXX")
    assert not game.is_terminal("XO.......")


def test_to_move():
    assert game.to_move("." * 9) == "X"
    assert game.to_move("X........") == "O"
    assert game.to_move("XO.......") == "X"
    with pytest.raises(ValueError, match="X must equal O or O \\+ 1"):
        game.to_move("XX.......")
    with pytest.raises(ValueError, match="X must equal O or O \\+ 1"):
        game.to_move("O........")


def test_apply_move():
    assert game.apply_move("." * 9, 5, "X") == "....X...."
    assert game.apply_move("....X....", 1, "O") == "O...X...."


@pytest.mark.parametrize(
    ("board", "square", "player", "error", "message"),
    [
        ("....X....", 5, "O", ValueError, "occupied"),
        ("." * 9, 0, "X", ValueError, "out of range"),
        ("." * 9, 10, "X", ValueError, "out of range"),
        ("." * 9, True, "X", TypeError, "must be an int"),
        ("." * 9, 1, "O", ValueError, "X's turn"),
        ("XXXOO....", 6, "O", ValueError, "terminal"),
    ],
)
def test_apply_move_rejects(board, square, player, error, message):
    with pytest.raises(error, match=message):
        game.apply_move(board, square, player)


@pytest.mark.parametrize("bad_board", ["X" * 8, "." * 10, "XO.x.....", "XO-......", 123, None])
def test_bad_board_raises_naming_it(bad_board):
    with pytest.raises(ValueError, match="board"):
        game.legal_moves(bad_board)


# ---------------------------------------------------------------- minimax, hand-checked


def test_empty_board_every_first_move_draws():
    assert game.best_moves("." * 9) == list(range(1, 10))


def test_must_win():
    # X X .      X wins at 3. Anything else but 6 lets O win at 6, and 6 only draws.
    # O O .
    # . . .
    assert game.best_moves("XX.OO....") == [3]


def test_must_block():
    # X O .      O threatens the middle column: only 8 holds the draw.
    # . O .
    # . . X
    assert game.best_moves("XO..O...X") == [8]


def test_fork():
    # X O .      4 forks (threats at 7 and 6), 7 forks (threats at 4 and 3); nothing else forces a win.
    # . X .
    # . . O
    assert game.best_moves("XO..X...O") == [4, 7]


def test_best_moves_rejects_terminal_board():
    with pytest.raises(ValueError, match="terminal"):
        game.best_moves("XXXOO....")


# ---------------------------------------------------------------- score_move and move_outcome


@pytest.mark.parametrize(
    ("board", "square", "outcome", "score"),
    [
        ("XO..O...X", 1, "occupied", -1.0),
        ("XO..O...X", 0, "out_of_range", -1.0),
        ("XO..O...X", 10, "out_of_range", -1.0),
        ("XO..O...X", -3, "out_of_range", -1.0),
        ("XX.OO....", 3, "win", 1.0),
        ("XO..O...X", 8, "optimal", 0.8),
        ("XO..O...X", 3, "legal_suboptimal", 0.0),
        ("XO..X...O", 4, "optimal", 0.8),
        ("XO..X...O", 3, "legal_suboptimal", 0.0),
    ],
)
def test_score_move_and_outcome(board, square, outcome, score):
    assert game.move_outcome(board, square) == outcome
    assert game.score_move(board, square) == score


def test_immediate_win_scores_one_even_when_another_move_also_forces_a_win():
    # X X .      3 and 4 win now. 6 does not, but it leaves threats at both 3 and 4, so it also
    # . O .      forces a win: game-theoretically optimal (0.8), not a win (1.0).
    # X O O
    board = "XX..O.XOO"
    wins_now = {square for square in game.legal_moves(board) if game.move_outcome(board, square) == "win"}
    assert wins_now == {3, 4}
    assert game.score_move(board, 3) == 1.0
    assert game.move_outcome(board, 6) == "optimal"
    assert game.score_move(board, 6) == 0.8


def test_move_outcome_rejects_non_int_square():
    for square in (True, 5.0, "5", None):
        with pytest.raises(TypeError):
            game.move_outcome("." * 9, square)


def test_outcomes_cover_move_labels():
    assert game.OUTCOMES == (
        "no_tool_call", "parse_error", "occupied", "out_of_range", "legal_suboptimal", "optimal", "win"
    )
    assert set(game.SCORE_BY_OUTCOME) == set(game.OUTCOMES) - {"no_tool_call", "parse_error"}


# ---------------------------------------------------------------- minimax against an independent negamax

# Independent implementation: bitmasks (bit i = square i + 1) instead of strings, a plain dict memo.
_LINE_MASKS = [
    sum(1 << i for i in line)
    for line in ([0, 1, 2], [3, 4, 5], [6, 7, 8], [0, 3, 6], [1, 4, 7], [2, 5, 8], [0, 4, 8], [2, 4, 6])
]


def _has_line(mask: int) -> bool:
    return any(mask & line == line for line in _LINE_MASKS)


def _reference_value(mover: int, other: int, memo: dict) -> int:
    """Value for the side owning `mover` to move: +1 win, 0 draw, -1 loss."""
    key = (mover, other)
    if key not in memo:
        if _has_line(other):
            memo[key] = -1
        elif mover | other == 0b111111111:
            memo[key] = 0
        else:
            memo[key] = max(
                -_reference_value(other, mover | (1 << i), memo)
                for i in range(9)
                if not (mover | other) & (1 << i)
            )
    return memo[key]


def _reference_best_moves(board: str, memo: dict) -> list[int]:
    x_mask = sum(1 << i for i, cell in enumerate(board) if cell == "X")
    o_mask = sum(1 << i for i, cell in enumerate(board) if cell == "O")
    values = {
        i + 1: -_reference_value(o_mask, x_mask | (1 << i), memo)
        for i in range(9)
        if not (x_mask | o_mask) & (1 << i)
    }
    best = max(values.values())
    return sorted(square for square, value in values.items() if value == best)


def test_best_moves_match_independent_negamax_on_every_reachable_board():
    memo: dict = {}
    boards = all_boards()
    assert len(boards) == 2423
    mismatches = [
        (board, game.best_moves(board), _reference_best_moves(board, memo))
        for board in boards
        if game.best_moves(board) != _reference_best_moves(board, memo)
    ]
    assert mismatches == [], f"{len(mismatches)} boards differ, first: {mismatches[:3]}"


# ---------------------------------------------------------------- board kinds (the evaluation's split)


@pytest.mark.parametrize(
    ("board", "kind", "x_wins", "o_wins"),
    [
        ("XX.OO....", "win", [3], [6]),  # X wins at 3 although O threatens 6
        ("X....XOO.", "block", [], [9]),  # O threatens 9; blocking it is the only move that does not lose
        (".....OXXO", "lost", [], [3]),  # blocking 3 walks into a fork: every move loses
        ("...XOXOXO", "lost", [], [1, 3]),  # two threats: X cannot block both
        ("XO.......", "other", [], []),
        ("." * 9, "other", [], []),
    ],
)
def test_board_kind_on_known_positions(board, kind, x_wins, o_wins):
    assert game.winning_squares(board, "X") == x_wins
    assert game.winning_squares(board, "O") == o_wins
    assert game.board_kind(board) == kind


def test_board_kinds_agree_with_minimax_on_every_dataset_board():
    counts = dict.fromkeys(game.BOARD_KINDS, 0)
    for board in all_boards():
        kind = game.board_kind(board)
        counts[kind] += 1
        best = game.best_moves(board)
        if kind == "win":  # taking the win is always optimal
            assert set(game.winning_squares(board, "X")) <= set(best), board
        elif kind == "block":  # the block rate is the optimal rate on these boards, exactly
            assert best == game.winning_squares(board, "O"), board
        elif kind == "lost":  # nothing to tell apart: every legal move is optimal
            assert best == game.legal_moves(board), board
    assert counts == {"win": 1498, "block": 360, "lost": 152, "other": 413}


def test_board_kind_refuses_terminal_boards():
    with pytest.raises(ValueError, match="terminal"):
        game.board_kind("XXXOO....")
