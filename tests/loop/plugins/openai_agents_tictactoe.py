"""A tic-tac-toe agent written with the OpenAI Agents SDK (PyPI `openai-agents`), run unchanged by rlsys
(docs/agents.md): the SDK's chat-completions model takes the episode's client, so every request goes through
the proxy in the episode's session. Tracing is off (no network at run time).

One model turn: the run stops at the first tool call (`stop_on_first_tool`), or ends on a text answer. The
output is the tic-tac-toe agent's (docs/CONTRACTS.md), with the call's arguments as the model wrote them.
"""
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from agents.items import MessageOutputItem, ToolCallItem

from rlsys.envs.tictactoe.prompt import SYSTEM_PROMPT, user_message

set_tracing_disabled(True)


@function_tool
def choose_square(square: int) -> str:
    """Place your X on a free square of the board.

    Args:
        square: Square number 1-9, row by row from the top left.
    """
    return f"You played {square}."


async def agent(item, client, model):
    player = Agent(name="X", instructions=SYSTEM_PROMPT, tools=[choose_square],
                   model=OpenAIChatCompletionsModel(model=model, openai_client=client),
                   model_settings=ModelSettings(max_tokens=24), tool_use_behavior="stop_on_first_tool")
    result = await Runner.run(player, user_message(item["board"]), max_turns=2)
    calls = [i.raw_item for i in result.new_items if isinstance(i, ToolCallItem)]
    texts = [i.raw_item.content[0].text for i in result.new_items
             if isinstance(i, MessageOutputItem) and i.raw_item.content]
    return {"content": texts[0] if texts else None,
            "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in calls],
            "finish_reason": "tool_calls" if calls else "stop"}
