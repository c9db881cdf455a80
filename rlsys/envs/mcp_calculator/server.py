"""A calculator MCP server over stdio: the example tool server of the MCP environment (rlsys/agents/mcp.py).

Run by the agent, one process per episode: `python -m rlsys.envs.mcp_calculator.server`. It imports only `mcp`
(not rlsys's heavy parts), so it starts in about a second. `MCPServer` is mcp 2's name for v1's `FastMCP`.
"""
from __future__ import annotations

from mcp.server.mcpserver import MCPServer

server = MCPServer("calculator")


@server.tool()
def add(a: float, b: float) -> float:
    """Return a + b."""
    return a + b


@server.tool()
def multiply(a: float, b: float) -> float:
    """Return a * b."""
    return a * b


if __name__ == "__main__":
    server.run("stdio")
