"""The MCP calculator reward: 1.0 when the final answer is the item's number, else 0.0.

`outcome` labels: 'correct', 'wrong' (a number, not the answer), 'no_answer' (no number, or the turn cap hit).
`validate_item` is the job's check of every dataset line (jobs/items.py `item_validator`).
"""
from __future__ import annotations

import math
import re

OUTCOMES = ("correct", "wrong", "no_answer")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def validate_item(item: dict) -> None:
    """Raise ValueError unless `item` is {"question": str, "answer": number, ...}."""
    if not isinstance(item.get("question"), str):
        raise ValueError("'question' must be a string")
    if isinstance(item.get("answer"), bool) or not isinstance(item.get("answer"), (int, float)):
        raise ValueError("'answer' must be a number")


def outcome(record: dict) -> str:
    answer = record["output"].get("answer") if isinstance(record["output"], dict) else None
    found = NUMBER.findall(answer) if isinstance(answer, str) else []
    if not found:
        return "no_answer"
    return "correct" if math.isclose(float(found[-1]), float(record["item"]["answer"])) else "wrong"


def reward(record: dict) -> float:
    return 1.0 if outcome(record) == "correct" else 0.0
