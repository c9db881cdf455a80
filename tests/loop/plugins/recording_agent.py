"""Test agent: the tic-tac-toe request, plus what the proxy says the engine sampled (its `rlsys` field)."""
from rlsys.envs.tictactoe.prompt import CHOOSE_SQUARE_TOOL, messages_for


async def agent(item, client, model):
    completion = await client.chat.completions.create(
        model=model, messages=messages_for(item["board"]), tools=[CHOOSE_SQUARE_TOOL],
        tool_choice={"type": "function", "function": {"name": "choose_square"}},
    )
    choice = completion.choices[0]
    ext = completion.model_extra["rlsys"]
    return {
        "content": choice.message.content,
        "tool_calls": [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls or []],
        "finish_reason": choice.finish_reason,
        "sampled_ids": ext["completion_ids"],
        "prompt_ids": ext["prompt_ids"],
    }
