"""Tic-tac-toe rules, a cached minimax, and the per-move score the reward is built on.

Why: the reward for the first rlsys environment is "how good is the square the model chose", which
needs exact rules and an exact game-theoretic oracle. Tic-tac-toe has only 5,478 reachable
positions, so a memoised negamax over all of them is instant and needs no heuristics.

Board encoding: a 9-character string over 'X', 'O', '.' in row-major order; squares are numbered
1..9 row-major (1 = top left, 3 = top right, 9 = bottom right). X always moves first, so X is to
move iff the counts of X and O are equal.

"Optimal" means game-theoretic value only (win > draw > loss with perfect play by both sides);
it does not prefer faster wins. So when an immediate win exists, a different move that still
forces a win later is also optimal: `score_move` gives the immediate win 1.0 and that move 0.8.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Literal

Player = Literal["X", "O"]

EMPTY = "."
SQUARES = tuple(range(1, 10))  # square numbers, 1..9 row-major

# The error-table labels, in the order the table prints them. The first two are decided by the
# reward (the model's output did not contain a usable call); the rest by `move_outcome`.
OUTCOMES = (
    "no_tool_call",
    "parse_error",
    "occupied",
    "out_of_range",
    "legal_suboptimal",
    "optimal",
    "win",
)

# Score per move outcome (the design's reward table, for the move-level labels).
SCORE_BY_OUTCOME = {
    "occupied": -1.0,
    "out_of_range": -1.0,
    "win": 1.0,
    "optimal": 0.8,
    "legal_suboptimal": 0.0,
}

# The eight lines, as 0-based string indices.
LINES = (
    (0, 1, 2), (3, 4, 5), (6, 7, 8),  # rows
    (0, 3, 6), (1, 4, 7), (2, 5, 8),  # columns
    (0, 4, 8), (2, 4, 6),  # diagonals
)


def validate_board(board: object) -> str:
    """Return `board` if it is a 9-character string over 'X', 'O', '.'; else raise ValueError.

    Only the encoding is checked here; piece counts are checked by `to_move`.
    """
    if not isinstance(board, str):
        raise ValueError(f"board must be a str, got {type(board).__name__}: {board!r}")
    if len(board) != 9:
        raise ValueError(f"board {board!r} has length {len(board)}, expected 9")
    bad_chars = set(board) - {"X", "O", EMPTY}
    if bad_chars:
        raise ValueError(f"board {board!r} has characters {sorted(bad_chars)}; allowed are 'X', 'O', '.'")
    return board


def legal_moves(board: str) -> list[int]:
    """The free squares (1..9) of `board`, ascending. Does not check whether the game is over."""
    validate_board(board)
    return [index + 1 for index, cell in enumerate(board) if cell == EMPTY]


def winner(board: str) -> Player | None:
    """'X' or 'O' if that player has three in a line, else None.

    Raises ValueError if both players have a line (no legal game reaches that).
    """
    validate_board(board)
    line_owners = {board[a] for a, b, c in LINES if board[a] != EMPTY and board[a] == board[b] == board[c]}
    if len(line_owners) > 1:
        raise ValueError(f"board {board!r} has a line for both X and O")
    return line_owners.pop() if line_owners else None


def is_terminal(board: str) -> bool:
    """True if someone has won or the board is full."""
    return winner(board) is not None or EMPTY not in board


def to_move(board: str) -> Player:
    """'X' if the counts of X and O are equal, 'O' if X has one more; else raise ValueError."""
    validate_board(board)
    x_count, o_count = board.count("X"), board.count("O")
    if x_count == o_count:
        return "X"
    if x_count == o_count + 1:
        return "O"
    raise ValueError(
        f"board {board!r} has {x_count} X and {o_count} O; X moves first, so X must equal O or O + 1"
    )


def _check_square(board: str, square: int) -> None:
    """Raise TypeError for a non-int square (bools included), ValueError if it is off the board or taken."""
    if isinstance(square, bool) or not isinstance(square, int):
        raise TypeError(f"square must be an int, got {type(square).__name__}: {square!r}")
    if square not in SQUARES:
        raise ValueError(f"square {square} is out of range 1..9 (board {board!r})")
    if board[square - 1] != EMPTY:
        raise ValueError(f"square {square} is occupied on board {board!r}")


def apply_move(board: str, square: int, player: Player) -> str:
    """The board after `player` marks `square`. Raises if the square is not free or the game is over.

    `player` must be the side to move, so every board this returns is reachable if `board` is.
    """
    validate_board(board)
    _check_square(board, square)
    if player not in ("X", "O"):
        raise ValueError(f"player must be 'X' or 'O', got {player!r}")
    if is_terminal(board):
        raise ValueError(f"board {board!r} is terminal; no move can be applied")
    if to_move(board) != player:
        raise ValueError(f"board {board!r}: it is {to_move(board)}'s turn, not {player}'s")
    index = square - 1
    return board[:index] + player + board[index + 1 :]


@lru_cache(maxsize=None)
def _negamax_value(board: str) -> int:
    """Game value for the side to move with perfect play: +1 win, 0 draw, -1 loss.

    Called only on validated boards with consistent counts. 5,478 reachable boards, so the cache is small.
    """
    if winner(board) is not None:
        return -1  # the previous mover completed a line: the side to move has lost
    if EMPTY not in board:
        return 0
    player = to_move(board)
    return max(-_negamax_value(apply_move(board, square, player)) for square in legal_moves(board))


@lru_cache(maxsize=None)
def _best_moves_cached(board: str) -> tuple[int, ...]:
    player = to_move(board)
    values = {square: -_negamax_value(apply_move(board, square, player)) for square in legal_moves(board)}
    best_value = max(values.values())
    return tuple(square for square, value in values.items() if value == best_value)


def best_moves(board: str) -> list[int]:
    """All squares with the best game-theoretic value for the side to move (X on dataset boards), ascending.

    Raises ValueError for a terminal board or inconsistent piece counts.
    """
    validate_board(board)
    to_move(board)  # validates the counts
    if is_terminal(board):
        raise ValueError(f"board {board!r} is terminal; it has no best move")
    return list(_best_moves_cached(board))


def move_outcome(board: str, square: int) -> str:
    """Label the side to move choosing `square`: 'out_of_range', 'occupied', 'win', 'optimal' or 'legal_suboptimal'.

    Out of range is checked first (a square off the board is neither free nor occupied).
    Raises TypeError for a non-int square (bool included) and ValueError for an invalid or terminal board.
    """
    validate_board(board)
    if isinstance(square, bool) or not isinstance(square, int):
        raise TypeError(f"square must be an int, got {type(square).__name__}: {square!r}")
    player = to_move(board)
    if is_terminal(board):
        raise ValueError(f"board {board!r} is terminal; no move can be scored")
    if square not in SQUARES:
        return "out_of_range"
    if board[square - 1] != EMPTY:
        return "occupied"
    if winner(apply_move(board, square, player)) == player:
        return "win"
    if square in _best_moves_cached(board):
        return "optimal"
    return "legal_suboptimal"


def score_move(board: str, square: int) -> float:
    """The reward for choosing `square`: out of range or occupied -1.0, immediate win 1.0, optimal 0.8, else 0.0."""
    return SCORE_BY_OUTCOME[move_outcome(board, square)]


# The kinds of boards the evaluation reports apart (`board_kind`), in the order it prints them.
BOARD_KINDS = ("win", "block", "lost", "other")


def winning_squares(board: str, player: Player) -> list[int]:
    """The free squares (ascending) where `player` would complete a line, whoever is to move."""
    validate_board(board)
    return [square for square in legal_moves(board)
            if any(square - 1 in line and all(board[i] == player for i in line if i != square - 1) for line in LINES)]


def board_kind(board: str) -> str:
    """What a board tests, for the side to move (X on dataset boards):

    - 'win': it has an immediate win (did the model take it?);
    - 'block': it has none, the opponent threatens to win next move, and blocking is the only move that does not
      lose (exactly the optimal moves; did the model block?);
    - 'lost': the opponent threatens and every move loses (two threats, or a block that walks into a fork): every
      legal move is optimal there, so a good and a bad answer cannot be told apart;
    - 'other': no immediate win or threat (did the model find an optimal move?).

    Raises ValueError for an invalid or terminal board.
    """
    validate_board(board)
    player = to_move(board)
    if is_terminal(board):
        raise ValueError(f"board {board!r} is terminal; it has no kind")
    if winning_squares(board, player):
        return "win"
    if not winning_squares(board, "O" if player == "X" else "X"):
        return "other"
    return "lost" if _negamax_value(board) == -1 else "block"
