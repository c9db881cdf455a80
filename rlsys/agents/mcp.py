"""An agent whose tools live in an MCP server: the server's tool list becomes the chat's `tools`, and every
call the model makes runs through the MCP session (PyPI `mcp`, 2.x).

Per episode: start the server as a subprocess over stdio, `initialize`, `list_tools` -> OpenAI function tools;
then turns of chat completion -> each tool call -> `call_tool` -> a role "tool" message with the result's text,
until the model answers without a call or `max_turns` turns. The proxy masks tool messages out of the loss as
it does any prompt text; the assistant message goes back exactly as returned (`assistant_echo`), so the session
stays one token sequence. A call the server rejects (unknown tool, bad arguments, a raising tool) comes back
as the server's error text in the tool message, as MCP's `is_error` result intends: it is the model's mistake,
for the reward to judge, not an agent failure. Arguments that are not a JSON object are answered the same way
without calling the server.

Why one server per episode, not one per worker: an episode's tools may keep state (a board, a ledger) that must
not leak into the next episode, and the stdio client is an async context that lives in one task. The cost is
the server's start (about a second for a small `MCPServer` script), against episodes of seconds.

Returned output: {"turns": [turn record (tictactoe_game/turns.py)], "tool_results": [{"name", "arguments",
"text", "is_error"}], "answer": str | None (the last turn's content when it made no call), "end": str}
with `end` one of "answer", "max_turns".
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlsys.envs.tictactoe_game.turns import assistant_echo, tool_message, turn_record

if TYPE_CHECKING:
    import openai


@dataclass(frozen=True)
class MCPServerCommand:
    """How to start a stdio MCP server: `command args...` in `cwd` with `env` added to the default environment."""

    command: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] | None = None
    cwd: str | None = None


def openai_tools(mcp_tools: list[Any]) -> list[dict]:
    """MCP `Tool`s (name, description, input_schema) as OpenAI function tools."""
    return [{"type": "function",
             "function": {"name": t.name, "description": t.description or "",
                          "parameters": t.input_schema or {"type": "object", "properties": {}}}}
            for t in mcp_tools]


def result_text(result: Any) -> str:
    """The text of a `CallToolResult`: its text parts joined, else its structured content as JSON."""
    texts = [part.text for part in result.content if getattr(part, "type", None) == "text"]
    if texts:
        return "\n".join(texts)
    return json.dumps(result.structured_content) if result.structured_content is not None else ""


async def run_with_mcp(server: MCPServerCommand, messages: list[dict], client: openai.AsyncOpenAI, model: str, *,
                       max_turns: int, **create_kwargs: Any) -> dict:
    """The tool loop of the module docstring; `create_kwargs` go to every chat completion (e.g. max_tokens)."""
    import sys

    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    params = StdioServerParameters(command=server.command, args=list(server.args), env=server.env, cwd=server.cwd)
    messages = list(messages)
    turns: list[dict] = []
    results: list[dict] = []
    async with stdio_client(params, errlog=sys.stderr) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        tools = openai_tools((await session.list_tools()).tools)
        for _ in range(max_turns):
            response = await client.chat.completions.create(model=model, messages=messages, tools=tools,
                                                            **create_kwargs)
            turn = turn_record(response)
            turns.append(turn)
            if not turn["tool_calls"]:
                return {"turns": turns, "tool_results": results, "answer": turn["content"], "end": "answer"}
            messages.append(assistant_echo(turn))
            for call in turn["tool_calls"]:
                done = await call_tool(session, call["name"], call["arguments"])
                results.append(done)
                messages.append(tool_message(call["id"], done["text"]))
    return {"turns": turns, "tool_results": results, "answer": None, "end": "max_turns"}


async def call_tool(session: Any, name: str, arguments: str) -> dict:
    """One call through the MCP session; arguments that are not a JSON object get an error text, uncalled."""
    try:
        args = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError as err:
        args, error = None, f"arguments are not JSON: {err}"
    else:
        error = None if isinstance(args, dict) else "arguments must be a JSON object"
    if error is not None:
        return {"name": name, "arguments": arguments, "text": error, "is_error": True}
    result = await session.call_tool(name, args)
    return {"name": name, "arguments": arguments, "text": result_text(result), "is_error": bool(result.is_error)}
