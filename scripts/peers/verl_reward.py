"""verl's custom reward for the tic-tac-toe side-by-side (issue 25): rlsys's own reward on verl's decoded response.

verl calls `compute_score(data_source, solution_str, ground_truth, extra_info)` (`custom_reward_function.path` /
`.name` in scripts/peers/verl_gspo.sh). `solution_str` is the response decoded without special tokens; the
`<tool_call>` tags are not special tokens in Qwen's vocabulary, so the text that rlsys's tool-call parser sees is the
proxy's text less the end-of-turn token, which the proxy drops too. NOT yet run with verl on a GPU.
"""
from __future__ import annotations

import json

from rlsys.envs.tictactoe.prompt import TOOL_NAME
from rlsys.envs.tictactoe.reward import reward
from rlsys.proxy.toolcalls import parse_tool_calls


def agent_output(text: str) -> dict:
    """What rlsys's tic-tac-toe agent returns for the completion `text` (the proxy's `_completion_body`)."""
    parsed = parse_tool_calls(text, [TOOL_NAME])
    calls = [{"name": c.name, "arguments": json.dumps(c.arguments)} for c in parsed.calls]
    return {"content": (parsed.content or None) if calls else text, "tool_calls": calls,
            "finish_reason": "tool_calls" if calls else "stop"}


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **_) -> float:
    item = json.loads(extra_info["item"])
    if item["board"] != ground_truth:
        raise ValueError(f"extra_info's item is for board {item['board']!r}, ground_truth says {ground_truth!r}")
    return reward({"item": item, "output": agent_output(solution_str)})
