"""The math word problem agent plug-in: `calculate` as often as the model likes, then `answer`, at most
MAX_TURNS turns (episode.py has the rules).

Per turn: one chat completion with both tools; every calculate call gets a role "tool" message with the
calculator's result or its error message (tool_call_id = the call's id); the assistant message goes back
exactly as the proxy returned it (turns.assistant_echo), so the session stays one token sequence and the tool
results are prompt tokens, outside the loss. The episode ends on answer, on a turn without a call, on a broken
call, after MAX_TURNS turns, or when the proxy refuses a request because the context is full.

Returned output (the reward's `record["output"]`; the reward replays the turns and reads nothing else):
    {"turns": [turn record, ...],                 # rlsys/envs/tictactoe_game/turns.py
     "calculations": [{"expression", "result", "ok"}], "answer": float | None, "end": str}
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from rlsys.envs.gsm.episode import Episode
from rlsys.envs.gsm.perturb import effective_item
from rlsys.envs.gsm.prompt import TOOLS, first_messages
from rlsys.envs.tictactoe_game.turns import play_tool_turns

if TYPE_CHECKING:
    import openai


async def solve(item: dict, client: openai.AsyncOpenAI, model: str, *, keep_prompt_ids: bool = False) -> dict:
    ep = Episode.start(effective_item(item))
    turns, end = await play_tool_turns(ep, first_messages(ep.item), client, model, TOOLS,
                                       keep_prompt_ids=keep_prompt_ids)
    return {"turns": turns, "calculations": ep.calculations, "answer": ep.answer, "end": end or ep.end}


async def agent(item: dict, client: openai.AsyncOpenAI, model: str) -> dict:
    return await solve(item, client, model)


async def agent_with_prompt_ids(item: dict, client: openai.AsyncOpenAI, model: str) -> dict:
    return await solve(item, client, model, keep_prompt_ids=True)
