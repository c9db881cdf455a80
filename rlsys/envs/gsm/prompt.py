"""What the model sees: the system prompt, the two tools' schemas, the question as the user message.

Tool results are the calculator's text (calculator.py): a number, or "error: ..." for a refused expression.
"""
from __future__ import annotations

CALCULATE, ANSWER = "calculate", "answer"
TOOL_NAMES = (CALCULATE, ANSWER)

SYSTEM_PROMPT = (
    "Solve the math word problem. Work it out step by step with the calculate tool, one arithmetic expression "
    "per call (numbers, + - * / // % ** and parentheses; no units, no variables). When you know the result, call "
    "answer with the final number only. Calling answer ends the problem."
)

TOOLS = [
    {"type": "function", "function": {
        "name": CALCULATE,
        "description": "Evaluate one arithmetic expression, e.g. (12 + 3) * 4 / 5, and return its value.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": ANSWER,
        "description": "Submit the final answer to the problem as a number. Ends the problem.",
        "parameters": {"type": "object", "properties": {"value": {"type": "number"}},
                       "required": ["value"], "additionalProperties": False}}},
]


def first_messages(item: dict) -> list[dict]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": item["question"]}]
