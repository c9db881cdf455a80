"""The whole-game agent plug-in: X plays until the game ends, one `choose_square` call per turn.

Per turn: one chat completion with the `choose_square` tool; the reply is applied to the game
(episode.py); while the game goes on, the assistant message goes back into the history exactly as
the proxy returned it (turns.assistant_echo: same content, same call id, same arguments JSON text)
followed by a role "tool" message (tool_call_id = the call's id) with O's reply and the new board.
A missing, broken, doubled or illegal call ends the game; the reward replays the turns.

Returned output (the reward's `record["output"]`):
    {"turns": [turn record, ...],          # turns.py; completion_ids included (the sampled ids)
     "outcome": str, "final_board": str}   # informational: the reward recomputes both from the turns

`agent_with_prompt_ids` also keeps each turn's prompt ids (tests compare them with the recorded
segments; the default leaves them out to keep trajectories small in the object store).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from rlsys.envs.tictactoe_game.episode import Game
from rlsys.envs.tictactoe_game.prompt import CHOOSE_SQUARE_TOOL, first_messages
from rlsys.envs.tictactoe_game.turns import assistant_echo, tool_message, turn_record

if TYPE_CHECKING:
    import openai


async def play(item: dict, client: openai.AsyncOpenAI, model: str, *, keep_prompt_ids: bool = False) -> dict:
    game = Game.start(item)
    messages = first_messages(item["start"], item.get("prompt_variant", "default"))
    turns: list[dict] = []
    while not game.over:  # at most 5 turns: X has at most 5 moves
        response = await client.chat.completions.create(model=model, messages=messages, tools=[CHOOSE_SQUARE_TOOL])
        turn = turn_record(response, keep_prompt_ids=keep_prompt_ids)
        turns.append(turn)
        result = game.play_turn(turn)
        if result is None:
            break
        messages += [assistant_echo(turn), tool_message(turn["tool_calls"][0]["id"], result)]
    return {"turns": turns, "outcome": game.outcome, "final_board": game.board}


async def agent(item: dict, client: openai.AsyncOpenAI, model: str) -> dict:
    return await play(item, client, model)


async def agent_with_prompt_ids(item: dict, client: openai.AsyncOpenAI, model: str) -> dict:
    return await play(item, client, model, keep_prompt_ids=True)
