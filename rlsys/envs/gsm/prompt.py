"""What the model sees: the system prompt, the two tools' schemas, the question as the user message.

Tool results are the calculator's text (calculator.py): a number, or "error: ..." for a refused expression.

Why the system prompt reads as it does: with a plain instruction ("work it out with the calculate tool, then call
answer") Qwen2.5-Coder-0.5B-Instruct wrote a chain of thought in text on 6 of 6 held-out problems (greedy, cut at
192 tokens: every episode `no_answer`), and a stricter one made it reply with the word "calculate". The calls
written out as examples fixed the format. "Reply with tool calls only" (the first version) left it no room to
reason: on the GPU, 256 held-out problems, greedy, it was right on 4.3%, malformed 35%, out of turns 19.5%. The
prompt now asks for short written steps with a calculate call each, and a text-only turn gets one nudge
(episode.py, NUDGE) instead of ending the episode. On the same 24 held-out problems (CPU, transformers engine,
greedy): right 2 -> 3, answered 0.58 -> 0.83, malformed 0.21 -> 0.12, out of turns 0.21 -> 0.04, reward
-0.33 -> -0.04 (a probe, not the GPU measurement).
"""
from __future__ import annotations

CALCULATE, ANSWER = "calculate", "answer"
TOOL_NAMES = (CALCULATE, ANSWER)

SYSTEM_PROMPT = (
    "Solve the math word problem step by step. Write each step as a short sentence, and do its arithmetic with "
    "the calculate tool, one expression per call (numbers, + - * / // % ** and parentheses; no units, no "
    "variables), for example\n"
    '<tool_call>\n{"name": "calculate", "arguments": {"expression": "(12 + 3) * 4"}}\n</tool_call>\n'
    "When you have the final result, call answer with it:\n"
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
