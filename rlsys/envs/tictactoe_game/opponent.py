"""The O player: random, or minimax with a blunder rate, deterministic given the item's seed.

Why deterministic per (seed, board), not a random stream per episode: the opponent's reply must be
the same on a rerun, in the reward's replay of the episode, and for every sample of a GRPO/GSPO group
that reaches the same board (so samples are compared against the same opponent policy). Hashing
(seed, board) gives that without any state carried between moves.

    random        a uniformly random free square
    minimax       with probability `blunder` a uniformly random free square, else a uniformly random
                  square among O's game-theoretically best ones (rlsys.envs.tictactoe.game.best_moves)
"""
from __future__ import annotations

import hashlib
import random

from rlsys.envs.tictactoe import game

OPPONENTS = ("random", "minimax")


def _rng(seed: int, board: str) -> random.Random:
    digest = hashlib.blake2b(f"tictactoe_game/{seed}/{board}".encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "little"))


def opponent_move(board: str, kind: str, blunder: float, seed: int) -> int:
    """O's square on `board` (O to move, game not over)."""
    if kind not in OPPONENTS:
        raise ValueError(f"unknown opponent {kind!r}; expected one of {OPPONENTS}")
    if not 0.0 <= blunder <= 1.0:
        raise ValueError(f"blunder rate must be in [0, 1], got {blunder!r}")
    if game.to_move(board) != "O" or game.is_terminal(board):
        raise ValueError(f"board {board!r}: not O to move in a running game")
    rng = _rng(seed, board)
    legal = game.legal_moves(board)
    if kind == "random" or rng.random() < blunder:
        return rng.choice(legal)
    return rng.choice(game.best_moves(board))
