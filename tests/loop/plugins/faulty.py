"""Test plug-ins that misbehave on purpose: the agent hangs on board 'hang', the reward raises on 'boom'."""
import asyncio

from rlsys.envs.tictactoe.agent import agent as tictactoe_agent


async def agent(item, client, model):
    if item["id"] == "hang":
        await asyncio.sleep(3600)
    return await tictactoe_agent(item, client, model)


def reward(record):
    if record["item"]["id"] == "boom":
        raise ValueError("reward exploded on purpose")
    return 0.0
