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
from rlsys.envs.ledger.agent import CONTEXT_FULL
from rlsys.envs.tictactoe_game.turns import assistant_echo, tool_message, turn_record

if TYPE_CHECKING:
    import openai


async def solve(item: dict, client: openai.AsyncOpenAI, model: str, *, keep_prompt_ids: bool = False) -> dict:
    import openai

    ep = Episode.start(effective_item(item))
    messages = first_messages(ep.item)
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
    return {"turns": turns, "calculations": ep.calculations, "answer": ep.answer, "end": end or ep.end}


async def agent(item: dict, client: openai.AsyncOpenAI, model: str) -> dict:
    return await solve(item, client, model)


async def agent_with_prompt_ids(item: dict, client: openai.AsyncOpenAI, model: str) -> dict:
    return await solve(item, client, model, keep_prompt_ids=True)
