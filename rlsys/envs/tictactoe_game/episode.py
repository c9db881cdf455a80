"""One game as a pure state machine over turn records: the agent plays it, the reward replays it.

Why one class for both: the agent drives `Game.play_turn` live against the proxy, and the reward
calls the same method on the turn records the agent returned. The reward therefore recomputes the
result from (item, what the model said) and never trusts a result the agent reports, and the two
cannot disagree about the rules.

A turn is the model's reply to one request (see turns.py for the record). Per turn, in order:
    any tool-call parse error in the turn, a call to another tool, arguments that are not JSON text
    of exactly {"square": <integer>}                                  -> 'parse_error', game over
    no tool call at all (text only, or cut by max_tokens)             -> 'no_tool_call', game over
    more than one call in the turn (one move per turn)                -> 'multiple_calls', game over
    square outside 1..9 / occupied                                    -> 'out_of_range' / 'occupied', game over
    legal: X is placed; X's line -> 'win'; full board -> 'draw'; else O answers (opponent.py);
           O's line -> 'loss'; full board -> 'draw'; else the tool result text for the next turn.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from rlsys.envs.tictactoe import game
from rlsys.envs.tictactoe_game.opponent import opponent_move
from rlsys.envs.tictactoe_game.prompt import TOOL_NAME, tool_result
from rlsys.envs.tictactoe_game.turns import replay_turns
from rlsys.proxy.toolcalls import parse_tool_calls

RESULTS = ("win", "draw", "loss")
FORFEITS = ("no_tool_call", "parse_error", "multiple_calls", "out_of_range", "occupied")


def square_of(turn: dict) -> int | str:
    """The square the turn plays, or the forfeit label saying why there is none."""
    calls = turn.get("tool_calls") or []
    content = turn.get("content")
    if turn.get("tool_call_errors"):
        return "parse_error"
    if not calls:
        # an agent that did not carry the proxy's errors: look for a call attempt in the text itself
        if isinstance(content, str):
            parsed = parse_tool_calls(content, {TOOL_NAME})
            if parsed.calls or parsed.errors:
                return "parse_error"
        return "no_tool_call"
    if len(calls) > 1:
        return "multiple_calls"
    call = calls[0]
    if not isinstance(call, dict) or call.get("name") != TOOL_NAME or not isinstance(call.get("arguments"), str):
        return "parse_error"
    try:
        arguments = json.loads(call["arguments"])
    except (ValueError, RecursionError):
        return "parse_error"
    if not isinstance(arguments, dict) or set(arguments) != {"square"} or type(arguments["square"]) is not int:
        return "parse_error"  # true, 5.0 and "5" are not integers: the schema says integer
    square = arguments["square"]
    if square not in game.SQUARES:
        return "out_of_range"
    return square


@dataclass
class Game:
    """X (the model) against the item's opponent, from the item's start board."""

    item: dict
    board: str
    moves: list[tuple[str, int]] = field(default_factory=list)  # ("X" | "O", square) in play order
    outcome: str | None = None  # set when the game is over: one of RESULTS or FORFEITS

    @classmethod
    def start(cls, item: dict) -> "Game":
        return cls(item=item, board=item["start"])

    @property
    def over(self) -> bool:
        return self.outcome is not None

    def play_turn(self, turn: dict) -> str | None:
        """Apply the model's turn; the tool result text if the game goes on, None once it is over."""
        if self.over:
            raise ValueError(f"game {self.item.get('id')!r} is over ({self.outcome}); no turn can follow")
        square = square_of(turn)
        if isinstance(square, str):
            self.outcome = square
            return None
        if self.board[square - 1] != game.EMPTY:
            self.outcome = "occupied"
            return None
        self._place("X", square)
        if self.over:
            return None
        o_square = opponent_move(self.board, self.item["opponent"], self.item["blunder"], self.item["seed"])
        self._place("O", o_square)
        if self.over:
            return None
        return tool_result(square, o_square, self.board, self.item.get("prompt_variant", "default"))

    def _place(self, player: str, square: int) -> None:
        self.board = game.apply_move(self.board, square, player)
        self.moves.append((player, square))
        winner = game.winner(self.board)
        if winner is not None:
            self.outcome = "win" if winner == "X" else "loss"
        elif game.EMPTY not in self.board:
            self.outcome = "draw"


def replay(item: dict, turns: list) -> Game:
    """The game the turn records describe. Turns that stop before the game is over leave
    `outcome` None (the reward calls that 'unfinished'); a turn after the end is an agent bug."""
    return replay_turns(Game.start(item), turns)
