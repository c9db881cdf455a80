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
from rlsys.envs.tictactoe_game.turns import assistant_echo, tool_message, turn_record

if TYPE_CHECKING:
    import openai

# How the proxy's 400 says the prompt fills the context: today only in the message text; OpenAI's code
# "context_length_exceeded" is accepted too (proposed for rlsys/proxy/server.py::_sampling_params).
CONTEXT_FULL = "leaves no room to generate"


async def run(item: dict, client: openai.AsyncOpenAI, model: str, *, keep_prompt_ids: bool = False) -> dict:
    import openai

    ep = Episode.start(item)
    messages = first_messages(item)
    turns: list[dict] = []
    end = None
    while not ep.over:
        try:
            response = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        except openai.BadRequestError as err:
            if turns and (getattr(err, "code", None) == "context_length_exceeded" or CONTEXT_FULL in str(err)):
                end = "context_full"
                break
            raise
        turn = turn_record(response, keep_prompt_ids=keep_prompt_ids)
        turns.append(turn)
        results = ep.play_turn(turn)
        if results is None:
            break
        messages.append(assistant_echo(turn))
        messages += [tool_message(call_id, text) for call_id, text in results]
    return {"turns": turns, "actions": ep.actions, "end": end or ep.end or "max_turns",
            "final_statuses": ep.ledger.statuses()}


async def agent(item: dict, client: openai.AsyncOpenAI, model: str) -> dict:
    return await run(item, client, model)


async def agent_with_prompt_ids(item: dict, client: openai.AsyncOpenAI, model: str) -> dict:
    return await run(item, client, model, keep_prompt_ids=True)
