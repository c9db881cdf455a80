"""One problem as a state machine over turn records: the agent plays it live, the reward replays it.

Per turn (one chat completion), in order:
    a tool-call parse error, or a call attempt in plain text the proxy did not deliver     -> 'malformed_call', over
    no tool call (text only, or cut by max_tokens): the first time, NUDGE goes back as a user message (the
    model may reason in text first); the second time, or at MAX_TURNS                   -> 'no_answer', over
    the turn's calls, in order:
        a call to another tool, arguments that are not exactly {"expression": str} for calculate or
        {"value": number} for answer (a plain decimal string such as "1,250" or "3.5" counts as a number)
                                                                                             -> 'malformed_call', over
        calculate: the calculator's result (or its "error: ..." message) is the call's tool result
        answer: the episode ends with that value; calls after it in the same turn are ignored
    after the turn, no answer yet and MAX_TURNS turns played                                 -> over
Outcome (`label`), from the final state: 'right' / 'wrong' (answered: the value within ANSWER_TOLERANCE of the
item's answer, relative, or not); 'malformed_call'; without an answer: 'calculator_error' if any calculate call
came back as an error (the likely reason the model gave up), else 'no_answer' (it stopped calling tools) or
'too_many_turns' (MAX_TURNS turns of calculations).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from rlsys.envs.gsm.calculator import CalculatorError, evaluate, format_number
from rlsys.envs.gsm.prompt import ANSWER, CALCULATE, TOOL_NAMES
from rlsys.envs.tictactoe_game.turns import replay_turns
from rlsys.proxy.toolcalls import parse_tool_calls

MAX_TURNS = 6
NUDGE = "Now call answer with the final number."
ANSWER_TOLERANCE = 1e-6
DECIMAL = re.compile(r"^[-+]?(\d{1,3}(,\d{3})+|\d+)(\.\d+)?$")


def answer_value(value: object) -> float | None:
    """The number `answer(value)` submits: a JSON number, or a plain decimal string ("1,250", "-3.5"); else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, str) and DECIMAL.match(value.strip()):
        return float(value.strip().replace(",", ""))
    return None


def is_right(value: float, answer: float) -> bool:
    return math.isclose(value, answer, rel_tol=ANSWER_TOLERANCE, abs_tol=ANSWER_TOLERANCE)


@dataclass
class Episode:
    item: dict
    turns: int = 0
    end: str | None = None  # 'answered' | 'malformed_call' | 'no_answer' | 'too_many_turns'; None while running
    answer: float | None = None
    calculations: list[dict] = field(default_factory=list)  # {"expression", "result", "ok"} per calculate call
    nudged: bool = False  # a text-only turn got NUDGE

    @classmethod
    def start(cls, item: dict) -> "Episode":
        return cls(item=item)

    @property
    def over(self) -> bool:
        return self.end is not None

    def play_turn(self, turn: dict) -> list[tuple[str | None, str]] | None:
        """Apply the model's turn: (call id, tool result text) per calculate call, or [(None, NUDGE)] after a first
        text-only turn (a user message), or None when the episode ends."""
        if self.over:
            raise ValueError(f"episode {self.item.get('id')!r} is over ({self.end}); no turn can follow (agent bug)")
        self.turns += 1
        calls = turn.get("tool_calls") or []
        if turn.get("tool_call_errors") or (not calls and _has_call_attempt(turn.get("content"))):
            self.end = "malformed_call"
            return None
        if not calls:
            if self.nudged or self.turns >= MAX_TURNS:
                self.end = "no_answer"
                return None
            self.nudged = True
            return [(None, NUDGE)]
        results = []
        for call in calls:
            arguments = _arguments(call)
            name = call.get("name") if isinstance(call, dict) else None
            if name == ANSWER and arguments is not None and set(arguments) == {"value"}:
                self.answer = answer_value(arguments["value"])
                self.end = "answered" if self.answer is not None else "malformed_call"
                return None
            if name != CALCULATE or arguments is None or set(arguments) != {"expression"} \
                    or not isinstance(arguments["expression"], str):
                self.end = "malformed_call"
                return None
            try:
                text, ok = format_number(evaluate(arguments["expression"])), True
            except CalculatorError as err:
                text, ok = str(err), False
            self.calculations.append({"expression": arguments["expression"], "result": text, "ok": ok})
            results.append((call.get("id", ""), text))
        if self.turns >= MAX_TURNS:
            self.end = "too_many_turns"
            return None
        return results

    @property
    def label(self) -> str:
        """The outcome (module docstring); 'no_answer' for turns that stop before the episode is over."""
        if self.end == "answered":
            return "right" if is_right(self.answer, float(self.item["answer"])) else "wrong"
        if self.end == "malformed_call":
            return "malformed_call"
        if any(not c["ok"] for c in self.calculations):
            return "calculator_error"
        return "too_many_turns" if self.end == "too_many_turns" else "no_answer"


def _arguments(call: object) -> dict | None:
    if not isinstance(call, dict) or not isinstance(call.get("arguments"), str):
        return None
    try:
        arguments = json.loads(call["arguments"])
    except (ValueError, RecursionError):
        return None
    return arguments if isinstance(arguments, dict) else None


def _has_call_attempt(content: object) -> bool:
    if not isinstance(content, str):
        return False
    parsed = parse_tool_calls(content, set(TOOL_NAMES))
    return bool(parsed.calls or parsed.errors)


def replay(item: dict, turns: list) -> Episode:
    return replay_turns(Episode.start(item), turns)
