"""What a multi-turn agent keeps of each proxy response, and the assistant message it sends back.

Why this matters: the proxy records a session as ONE token sequence only when each new prompt starts
with the previous prompt + the tokens the engine sampled (rlsys/proxy/sessions.py). When the agent
sends the assistant message back exactly as the proxy returned it (the same `content`, None stays
None, and the same `tool_calls` with the same arguments), followed by new messages, the proxy builds
the next prompt from the previous prompt and sampled ids plus the template's tokens for the new
messages (rlsys/proxy/continuation.py), so the sequence extends whatever the sampled text would
re-render to (a bare or fenced JSON call, compact JSON, text around a call, a stop on <|endoftext|>).
`assistant_echo` does exactly that and nothing more. An agent that edits the history instead gets a
full re-render of the conversation, and a `segment_break` wherever that re-render differs from what
was sampled (docs/results-multiturn.md lists the cases for the tiny model's Qwen2.5-style template);
nothing is trained on mismatched tokens.

Used by the multi-turn environments (tictactoe_game, ledger, gsm). It belongs in a shared module
(e.g. rlsys/envs/multiturn.py); it lives here because this is the first multi-turn environment.

Turn record (one per chat completion, JSON-serialisable, what agents return and rewards replay):
    {"content": str | None, "tool_calls": [{"id": str, "name": str, "arguments": str (JSON text)}],
     "finish_reason": str, "tool_call_errors": [{"kind": str, "message": str}],
     "completion_ids": [int], ("prompt_ids": [int] when asked for)}
"""
from __future__ import annotations

from typing import Any, TypeVar

_Episode = TypeVar("_Episode")


def turn_record(response: Any, *, keep_prompt_ids: bool = False) -> dict:
    """The turn record of an `openai` ChatCompletion from the rlsys proxy (its `rlsys` extension field
    carries the sampled ids and the parser's errors; another server gives empty lists there)."""
    choice = response.choices[0]
    message = choice.message
    ext = (getattr(response, "model_extra", None) or {}).get("rlsys") or {}
    record = {
        "content": message.content,
        "tool_calls": [
            {"id": call.id, "name": call.function.name, "arguments": call.function.arguments}
            for call in message.tool_calls or []
        ],
        "finish_reason": choice.finish_reason,
        "tool_call_errors": [{"kind": e.get("kind", ""), "message": e.get("message", "")}
                             for e in ext.get("tool_call_errors") or []],
        "completion_ids": list(ext.get("completion_ids") or []),
    }
    if keep_prompt_ids:
        record["prompt_ids"] = list(ext.get("prompt_ids") or [])
    return record


def assistant_echo(turn: dict) -> dict:
    """The assistant message for the next request: content and tool calls exactly as returned."""
    message: dict[str, Any] = {"role": "assistant", "content": turn["content"]}
    if turn["tool_calls"]:
        message["tool_calls"] = [
            {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}
            for call in turn["tool_calls"]
        ]
    return message


def tool_message(call_id: str, content: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def replay_turns(episode: _Episode, turns: list) -> _Episode:
    """``episode`` (a freshly started episode of a multi-turn environment) after `play_turn` of every turn record
    in ``turns``, in order; something that is not a turn record is an agent bug (ValueError)."""
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise ValueError(f"turn {i} is a {type(turn).__name__}, not a turn record (agent bug)")
        episode.play_turn(turn)
    return episode


# How the proxy's 400 says the prompt fills the context: today only in the message text; OpenAI's code
# "context_length_exceeded" is accepted too (proposed for rlsys/proxy/server.py::_sampling_params).
CONTEXT_FULL = "leaves no room to generate"


async def play_tool_turns(episode: Any, messages: list[dict], client: Any, model: str, tools: list,
                          *, keep_prompt_ids: bool = False) -> tuple[list[dict], str | None]:
    """Ask the model, let `episode.play_turn` answer its tool calls, send the results back (a result without a call
    id as a user message: gsm's nudge after a text-only turn), until `episode.over` or `play_turn` returns None. Returns the turn records and "context_full" when the proxy refused a later
    prompt for filling the context (a first prompt that does is the caller's error and raises), else None."""
    import openai

    turns: list[dict] = []
    while not episode.over:
        try:
            response = await client.chat.completions.create(model=model, messages=messages, tools=tools)
        except openai.BadRequestError as err:
            if turns and (getattr(err, "code", None) == "context_length_exceeded" or CONTEXT_FULL in str(err)):
                return turns, "context_full"
            raise
        turn = turn_record(response, keep_prompt_ids=keep_prompt_ids)
        turns.append(turn)
        results = episode.play_turn(turn)
        if results is None:
            break
        messages.append(assistant_echo(turn))
        messages += [tool_message(call_id, text) if call_id is not None else {"role": "user", "content": text}
                     for call_id, text in results]
    return turns, None
