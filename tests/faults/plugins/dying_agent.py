"""Fault plug-in: the env worker process running this agent kills itself (SIGKILL) mid-episode.

Item field "die": "always" dies on every attempt; "once" dies only while the marker file named by the
item's "marker" field does not exist yet (so Ray's one retry, on a restarted worker, succeeds)."""
import os
import signal
from pathlib import Path

from rlsys.envs.tictactoe.agent import agent as tictactoe_agent


async def agent(item, client, model):
    result = await tictactoe_agent(item, client, model)  # a real turn first: the proxy has recorded it
    mode = item.get("die")
    if mode == "always" or (mode == "once" and not Path(item["marker"]).exists()):
        if mode == "once":
            Path(item["marker"]).write_text("died once\n")
        os.kill(os.getpid(), signal.SIGKILL)
    return result
