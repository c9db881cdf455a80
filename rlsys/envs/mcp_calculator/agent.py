"""The MCP calculator environment's agent: an arithmetic question, tools from the calculator MCP server
(server.py, started per episode over stdio by rlsys/agents/mcp.py), at most `MAX_TURNS` turns.

Item: {"id": str, "question": str, "answer": number}. Output: rlsys/agents/mcp.py's `run_with_mcp` output.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rlsys.agents.mcp import MCPServerCommand, run_with_mcp

if TYPE_CHECKING:
    import openai

MAX_TURNS = 4
SYSTEM_PROMPT = "Answer the arithmetic question. Use the calculator tools, then reply with the number only."
# the worker's interpreter, in the repository root so that `-m rlsys...` resolves from any working directory
SERVER = MCPServerCommand(command=sys.executable, args=["-m", "rlsys.envs.mcp_calculator.server"],
                          cwd=str(Path(__file__).resolve().parents[3]))


async def agent(item: dict, client: openai.AsyncOpenAI, model: str) -> dict:
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": item["question"]}]
    return await run_with_mcp(SERVER, messages, client, model, max_turns=MAX_TURNS)
