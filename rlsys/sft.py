"""Supervised chats -> training segments, rendered by the model's own chat template.

An SFT item is `{"messages": [...], "tools": [...]?}` (the format TRL and OpenRLHF read). Every assistant
turn is learned (its tokens up to and including the end-of-turn token); system, user and tool text is
masked. Each assistant turn's tokens are found by rendering the chat up to it with a generation prompt
and then with it, so the loss covers exactly what the model would have had to generate at that point.
"""
from __future__ import annotations

from typing import Any

from rlsys.errors import UserInputError
from rlsys.types import Segment


class SFTItemError(UserInputError):
    """An SFT item that cannot be rendered; the message says which item and why."""


def _ids(rendered: Any) -> list[int]:
    if isinstance(rendered, dict) or hasattr(rendered, "input_ids"):
        rendered = rendered["input_ids"]
    return [int(i) for i in rendered]


def render_chat(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None) -> Segment:
    """One segment: the whole chat's token ids, loss mask 1 on the assistant turns' tokens."""
    if not messages or not isinstance(messages, list):
        raise SFTItemError("'messages' must be a non-empty list")
    assistant_at = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"]
    if not assistant_at:
        raise SFTItemError("no assistant message to learn")

    def render(msgs: list[dict], generation_prompt: bool) -> list[int]:
        return _ids(tokenizer.apply_chat_template(msgs, tools=tools or None, add_generation_prompt=generation_prompt,
                                                  tokenize=True, return_dict=False))

    full = render(messages, False)
    mask = [0] * len(full)
    end_ids = {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>",)} | {tokenizer.eos_token_id}
    for i in assistant_at:
        start = render(messages[:i], True)
        upto = render(messages[: i + 1], False)
        if full[: len(upto)] != upto or upto[: len(start)] != start:
            raise SFTItemError(f"the chat template does not render messages[{i}] as a prefix extension")
        end = len(upto)
        # learn the answer and its end-of-turn token, not the template's whitespace after it
        for j in range(len(start), len(upto)):
            if upto[j] in end_ids:
                end = j + 1
                break
        for j in range(len(start), end):
            mask[j] = 1
    return Segment(input_ids=full, loss_mask=mask, rollout_logprobs=[0.0] * len(full))
