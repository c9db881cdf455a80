"""What the model sees: the system prompt, the two tools' schemas, the question as the user message.

Tool results are the calculator's text (calculator.py): a number, or "error: ..." for a refused expression.

Why the system prompt shows the two calls written out: with a plain instruction ("work it out with the calculate
tool, then call answer") Qwen2.5-Coder-0.5B-Instruct wrote a chain of thought in text on 6 of 6 held-out problems
(greedy, cut at 192 tokens: every episode `no_answer`, so every GSPO group would score -1 alike), and a stricter
instruction made it reply with the word "calculate". With the example calls, of 8 episodes (4 problems x 2 at
temperature 1) 5 called calculate and then answer (all 5 wrong), 2 ended on a malformed call (one after three good
calculate turns), 1 answered in prose (CPU probe with `rlsys eval --n 4 --samples 2 --temperature 1`, transformers
engine; a smoke check, not a measurement).
"""
from __future__ import annotations

CALCULATE, ANSWER = "calculate", "answer"
TOOL_NAMES = (CALCULATE, ANSWER)

SYSTEM_PROMPT = (
    "Solve the math word problem with the tools. Do the arithmetic with calculate, one expression per call "
    "(numbers, + - * / // % ** and parentheses; no units, no variables), then call answer with the final number. "
    "Reply with tool calls only, for example\n"
    '<tool_call>\n{"name": "calculate", "arguments": {"expression": "(12 + 3) * 4"}}\n</tool_call>\n'
    "and once you have the result\n"
    '<tool_call>\n{"name": "answer", "arguments": {"value": 60}}\n</tool_call>'
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
