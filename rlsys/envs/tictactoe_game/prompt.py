"""Prompt text for a whole game: the single-move prompts of rlsys.envs.tictactoe plus one sentence.

The first request is the single-move env's [system, user] pair (or one of its perturbed variants),
with a sentence saying the game goes on; later requests add the assistant's call and a tool message
with O's reply and the new board. Reusing the single-move wording keeps the two environments
comparable (a policy trained on one sees familiar text in the other).

Tool result, while the game goes on (board drawn as the variant draws it):
    You played 5. O played 1.
    O|2|3
    4|X|6
    7|8|9
    Your move.
"""
from __future__ import annotations

from rlsys.envs.tictactoe.prompt import (
    CHOOSE_SQUARE_TOOL,
    PERTURBATIONS,
    SYSTEM_PROMPT,
    TOOL_NAME,
    perturbed_messages,
    render_board,
    render_board_alt,
    user_message,
)

__all__ = ["CHOOSE_SQUARE_TOOL", "TOOL_NAME", "VARIANTS", "first_messages", "tool_result"]

VARIANTS = ("default", *PERTURBATIONS)

# No tool name in it, so the 'tool_renamed' variant stays free of "choose_square".
GAME_SENTENCE = ("You play a whole game against O: after each of your moves the tool answers with O's move "
                 "and the new board.")


def first_messages(board: str, variant: str = "default") -> list[dict]:
    """[system, user] for the start of a game on `board` (X to move)."""
    if variant == "default":
        system, user = SYSTEM_PROMPT, user_message(board)
    else:
        base = perturbed_messages(board, variant)
        system, user = base[0]["content"], base[1]["content"]
    return [{"role": "system", "content": f"{system} {GAME_SENTENCE}"}, {"role": "user", "content": user}]


def tool_result(x_square: int, o_square: int, board: str, variant: str = "default") -> str:
    """The tool message after X played `x_square` and O answered `o_square`, leaving `board`."""
    drawn = render_board_alt(board) if variant == "grid_alt" else render_board(board)
    return f"You played {x_square}. O played {o_square}.\n{drawn}\nYour move."
