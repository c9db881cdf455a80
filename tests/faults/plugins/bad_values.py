"""Fault plug-ins: the agent raises on item 'raise'; the reward returns garbage on items named after it."""
from rlsys.envs.tictactoe.agent import agent as tictactoe_agent


async def agent(item, client, model):
    if item["id"] == "raise":
        raise RuntimeError("agent exploded on purpose")
    return await tictactoe_agent(item, client, model)


def reward(record):
    return {"nan": float("nan"), "inf": float("inf"), "none": None, "str": "high", "bool": True}.get(
        record["item"]["id"], 0.0)
