"""The ledger agent plug-in: a tool loop over the three ledger tools, capped at `item["max_turns"]` turns.

The environment state lives here, in the episode: `episode.Episode` builds the in-memory ledger from
the item and runs every tool call the model makes against it. Per turn: one chat completion with the
tools; each call runs in order and gets a role "tool" message (tool_call_id = the call's id); the
assistant message goes back exactly as the proxy returned it (turns.assistant_echo), so the session
stays one token sequence. The episode ends when the model answers without a call, makes a broken
call, reaches `max_turns`, or when the proxy refuses a request because the context is full (the
conversation so far stands; the reward judges the ledger as it is).

Returned output (the reward's `record["output"]`):
    {"turns": [turn record, ...],                     # turns.py; the reward replays these
     "actions": [{"name", "arguments", "ok", "changed"}], "end": str,
     "final_statuses": {id: status}}                  # informational only: the reward ignores them
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from rlsys.envs.ledger.episode import Episode
from rlsys.envs.ledger.prompt import TOOLS, first_messages
from rlsys.envs.tictactoe_game.turns import play_tool_turns

if TYPE_CHECKING:
    import openai


async def run(item: dict, client: openai.AsyncOpenAI, model: str, *, keep_prompt_ids: bool = False) -> dict:
    ep = Episode.start(item)
    turns, end = await play_tool_turns(ep, first_messages(item), client, model, TOOLS, keep_prompt_ids=keep_prompt_ids)
    return {"turns": turns, "actions": ep.actions, "end": end or ep.end or "max_turns",
            "final_statuses": ep.ledger.statuses()}


async def agent(item: dict, client: openai.AsyncOpenAI, model: str) -> dict:
    return await run(item, client, model)


async def agent_with_prompt_ids(item: dict, client: openai.AsyncOpenAI, model: str) -> dict:
    return await run(item, client, model, keep_prompt_ids=True)
