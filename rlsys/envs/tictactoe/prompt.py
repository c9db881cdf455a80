"""Prompt text and the `choose_square` tool for tic-tac-toe, shared by the agent, SFT data and eval.

Why one module: the policy must see byte-identical prompts in SFT, RL rollouts and eval, or the
eval measures a prompt change rather than the policy. Everything here is a pure function of the board.

The board is drawn compactly (fewer tokens for a tiny CPU model): three rows, free squares show
their number, taken squares show X or O, cells separated by '|':
    X|2|O
    4|X|6
    7|8|9

Perturbed prompts (`perturbed_messages`) test robustness on held-out eval. The tool schema is never
changed; only the text around it is:
    'grid_alt'         the board drawn on one line with spaces and slashes: "X 2 O / 4 X 6 / 7 8 9"
    'system_reworded'  the same instructions in different words
    'shuffled_system'  the default system prompt's sentences in a fixed different order
    'tool_renamed'     the prose calls the tool "the move tool" instead of naming choose_square
                       (the design's "tool renamed in the prompt text"; the schema name is unchanged)
"""
from __future__ import annotations

from rlsys.envs.tictactoe import game

TOOL_NAME = "choose_square"

_SYSTEM_SENTENCES = (
    "You play tic-tac-toe as X.",
    "Squares are numbered 1-9, left to right, top to bottom.",
    f"Call {TOOL_NAME} with the number of a free square.",
)
SYSTEM_PROMPT = " ".join(_SYSTEM_SENTENCES)

_SYSTEM_REWORDED = (
    "This is a game of noughts and crosses and your mark is X. "
    f"Pick your move by invoking {TOOL_NAME}; pass the square's number, counted 1 to 9 "
    "row by row starting at the top left. The square must be empty."
)
# A fixed permutation of `_SYSTEM_SENTENCES` that differs from the identity.
_SHUFFLED_ORDER = (2, 0, 1)
_SYSTEM_TOOL_RENAMED = (
    "You play tic-tac-toe as X. Squares are numbered 1-9, left to right, top to bottom. "
    "Use the move tool to place your X on a free square."
)

PERTURBATIONS = ("grid_alt", "system_reworded", "shuffled_system", "tool_renamed")

CHOOSE_SQUARE_TOOL = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Place your X on a free square of the board.",
        "parameters": {
            "type": "object",
            "properties": {
                "square": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": 9,
                    "description": "Square number 1-9, row by row from the top left.",
                },
            },
            "required": ["square"],
            "additionalProperties": False,
        },
    },
}


def _cells(board: str) -> list[str]:
    """Nine cell labels: 'X' / 'O' for taken squares, the square number for free ones."""
    game.validate_board(board)
    return [cell if cell != game.EMPTY else str(index + 1) for index, cell in enumerate(board)]


def render_board(board: str) -> str:
    """The board as three '|'-separated rows, e.g. "X|2|O\\n4|X|6\\n7|8|9"."""
    cells = _cells(board)
    return "\n".join("|".join(cells[row * 3 : row * 3 + 3]) for row in range(3))


def render_board_alt(board: str) -> str:
    """The board on one line, rows separated by ' / ', e.g. "X 2 O / 4 X 6 / 7 8 9" (for 'grid_alt')."""
    cells = _cells(board)
    return " / ".join(" ".join(cells[row * 3 : row * 3 + 3]) for row in range(3))


def user_message(board: str) -> str:
    """The user turn: the drawn board and the request for a move."""
    return f"{render_board(board)}\nYour move."


def messages_for(board: str) -> list[dict]:
    """The chat messages for `board`: [system, user] in OpenAI format."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": user_message(board)},
    ]


def perturbed_messages(board: str, variant: str) -> list[dict]:
    """`messages_for(board)` with one perturbation applied (see the module docstring for `variant`)."""
    system, user = SYSTEM_PROMPT, user_message(board)
    if variant == "grid_alt":
        user = f"Board: {render_board_alt(board)}\nYour move."
    elif variant == "system_reworded":
        system = _SYSTEM_REWORDED
    elif variant == "shuffled_system":
        system = " ".join(_SYSTEM_SENTENCES[index] for index in _SHUFFLED_ORDER)
    elif variant == "tool_renamed":
        system = _SYSTEM_TOOL_RENAMED
    else:
        raise ValueError(f"unknown prompt variant {variant!r}; expected one of {PERTURBATIONS}")
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]
