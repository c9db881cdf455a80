"""The tic-tac-toe agent plug-in: one chat completion per board, forced to call `choose_square`.

Why this shape: it is the smallest agent that exercises the whole agent path (OpenAI client ->
proxy -> engine -> tool-call parser) and returns exactly what reward.py needs. It sets no
sampling parameters (temperature, max_tokens): the proxy applies the job's sampling settings,
so the same agent file serves training, eval and play.

Prompt variants (held-out robustness eval, `rlsys eval --perturb`): an item may carry
`"prompt_variant"`, one of prompt.PERTURBATIONS; the agent then sends `perturbed_messages(board, variant)`.
Items without the key (or with "default") get `messages_for(board)`, byte-identical to training.

Returned output (docs/CONTRACTS.md, "Tic-tac-toe agent output"):
    {"content": str | None, "tool_calls": [{"name": str, "arguments": str (JSON text)}], "finish_reason": str}
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from rlsys.envs.tictactoe.prompt import CHOOSE_SQUARE_TOOL, TOOL_NAME, messages_for, perturbed_messages

if TYPE_CHECKING:
    import openai


async def agent(item: dict, client: openai.AsyncOpenAI, model: str) -> dict:
    """Ask `model` (through `client`, pointed at the proxy) for a move on `item['board']`."""
    response = await client.chat.completions.create(model=model, **first_request(item))
    choice = response.choices[0]
    message = choice.message
    return {
        "content": message.content,
        "tool_calls": [
            {"name": tool_call.function.name, "arguments": tool_call.function.arguments}
            for tool_call in message.tool_calls or []
        ],
        "finish_reason": choice.finish_reason,
    }


def first_request(item: dict) -> dict:
    """The request body for `item` without the model: its chat, the tool, the forced call."""
    return {"messages": item_messages(item), "tools": [CHOOSE_SQUARE_TOOL],
            "tool_choice": {"type": "function", "function": {"name": TOOL_NAME}}}


def item_messages(item: dict) -> list[dict]:
    """The chat for `item`: the training prompt, or the perturbation named by `item["prompt_variant"]`."""
    variant = item.get("prompt_variant") or "default"
    if variant == "default":
        return messages_for(item["board"])
    return perturbed_messages(item["board"], variant)  # raises ValueError naming the known variants
