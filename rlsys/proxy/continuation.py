"""Build a session's next prompt from token ids, not from a re-render of the history (verl/SkyRL style).

The chat template re-renders the whole conversation on every request. When the model's sampled
assistant text does not re-render to the same ids (compact or key-reordered JSON in a call, a bare or
```json-fenced call that the template re-renders as a ``<tool_call>`` block, text around a call, a stop
on ``<|endoftext|>``, a cut by ``max_tokens``, a non-canonical BPE split), the new prompt does not
extend the previous turn's tokens and the session breaks into a new segment. Measured with Qwen 0.5B's
habits that is about one break per turn.

So when a request is the previous request of the same session plus the assistant message exactly as
the proxy returned it plus new messages (tool results, user text), the prompt is

    previous prompt ids + previous sampled ids [+ the template's end-of-turn id if the engine stopped
    without an end token] + the template's tokens for the new messages only

and it extends the previous segment by construction. Everything else (an edited or truncated history,
a changed system prompt or tool list, a reply the agent rewrote) gets today's full render, and a new
segment when its ids do not extend.

How the tokens for the new messages (the *delta*) are found, without assuming a template: render
``history + [canonical assistant] + new`` (with the generation prompt) twice, with two content-only
canonical replies whose last characters differ (``CANONICAL_REPLIES``). The two renders differ only in
the reply, so their longest common suffix is what the template puts after the reply's text. It must
start with an end-of-turn id (the split point), and the text before it must end with the canonical
reply in both renders; the delta is that common suffix after the end-of-turn id (for Qwen2.5:
``"\\n"``, the new turns, ``"<|im_start|>assistant\\n"``). A check that fails falls back to the full
render, with the reason counted (``FALLBACK_REASONS``).

Known limits: the delta assumes the template renders the new messages the same way after any assistant
message; a template that renders tool results differently depending on the preceding assistant's
``tool_calls`` would get the content-only canonical reply's rendering. A template that puts text between
an assistant's content and its end-of-turn token falls back every time ("no_split_point"). Templates
that rewrite earlier turns when a new one arrives (Qwen3 drops the ``<think>`` blocks of older turns)
get the ids as they were sampled, which is what the model saw, not what a full render would give.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from rlsys.proxy.schema import RequestError

CANONICAL_REPLIES = ("OK", "Yes")  # last characters differ, so their last tokens differ in any vocabulary

FIRST = "first"  # the session's first request (nothing to extend)
FROM_IDS = "prompt_from_ids"  # previous prompt + sampled ids + rendered delta
RE_RENDERED = "re_rendered"  # a later request rendered in full
FALLBACK_REASONS = (
    "tools_changed",  # the tool list (or tool_choice "none") differs from the previous request's
    "history_changed",  # the previous request's messages are not a prefix of this one's
    "reply_changed",  # the message after them is not the assistant reply the proxy returned
    "no_new_messages",  # nothing after the echoed reply
    "template_error",  # the template refused the canonical renders
    "no_split_point",  # the template puts something other than an end-of-turn id after a reply's text
)


@dataclass(frozen=True)
class Exchange:
    """What the proxy keeps of a session's latest request, to build the next prompt from ids."""

    messages: tuple[str, ...]  # (M,) each request message in template form, as JSON text
    tools: str  # the template's tools as JSON text ("null" without tools)
    prompt_ids: list[int]  # (P,) the ids the engine was given
    completion_ids: list[int]  # (C,) the ids it sampled
    reply: str  # the returned assistant message as reply_key() text


@dataclass(frozen=True)
class PromptPlan:
    """The prompt of one request and how it was made."""

    prompt_ids: list[int]  # (P,)
    source: str  # FIRST | FROM_IDS | RE_RENDERED
    reason: str = ""  # one of FALLBACK_REASONS when source is RE_RENDERED


def message_keys(messages: list[dict[str, Any]]) -> tuple[str, ...]:
    """Per-message JSON text of template-form messages: equal text = the same message, key order kept."""
    return tuple(json.dumps(m, ensure_ascii=False) for m in messages)


def tools_key(tools: list[dict[str, Any]] | None) -> str:
    return json.dumps(tools, ensure_ascii=False)


def reply_key(content: str | None, calls: list[tuple[str, Any]]) -> str:
    """An assistant message compared semantically: content (None = ""), call names and arguments
    (key order ignored); call ids and the arguments' JSON spacing do not matter."""
    return json.dumps({"content": content or "", "calls": [[name, args] for name, args in calls]},
                      ensure_ascii=False, sort_keys=True)


def template_reply_key(message: dict[str, Any]) -> str | None:
    """reply_key() of a template-form message, or None when it is not an assistant message."""
    if message.get("role") != "assistant":
        return None
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
    return reply_key(message.get("content"), calls)


def plan_prompt(
    previous: Exchange | None,
    messages: list[dict[str, Any]],
    keys: tuple[str, ...],
    tools: list[dict[str, Any]] | None,
    render: Callable[[list[dict[str, Any]]], list[int]],
    end_ids: Collection[int],
    decode: Callable[[list[int]], str],
) -> PromptPlan | str:
    """The prompt from ids when ``messages`` continue ``previous``; else the fallback reason (a str).

    ``render(messages)`` is the chat template with this request's tools and the generation prompt; it
    raises ``RequestError`` on a conversation the template refuses (then "template_error").
    ``keys`` = message_keys(messages).
    """
    if previous is None:
        return FIRST
    if tools_key(tools) != previous.tools:
        return "tools_changed"
    n = len(previous.messages)
    if len(keys) <= n or keys[:n] != previous.messages:
        return "history_changed"
    if template_reply_key(messages[n]) != previous.reply:
        return "reply_changed"
    if len(keys) == n + 1:
        return "no_new_messages"
    delta = _delta_after_assistant(messages[:n], messages[n + 1:], render, end_ids, decode)
    if isinstance(delta, str):
        return delta
    end_of_turn, new_ids = delta
    sampled = previous.completion_ids
    closed = bool(sampled) and sampled[-1] in end_ids
    ids = previous.prompt_ids + sampled + ([] if closed else [end_of_turn]) + new_ids
    return PromptPlan(ids, FROM_IDS)


def _delta_after_assistant(history: list[dict], new: list[dict], render: Callable[[list[dict]], list[int]],
                           end_ids: Collection[int], decode: Callable[[list[int]], str]) -> tuple[int, list[int]] | str:
    """(the template's end-of-turn id, the ids it renders after an assistant turn for ``new``)."""
    try:
        a, b = (render(history + [{"role": "assistant", "content": reply}] + new) for reply in CANONICAL_REPLIES)
    # no delta; the full render decides whether the request itself is an error
    except RequestError:
        return "template_error"
    common = 0
    while common < min(len(a), len(b)) and a[-1 - common] == b[-1 - common]:
        common += 1
    split_a, split_b = len(a) - common, len(b) - common
    if common < 2 or a[split_a] not in end_ids:
        return "no_split_point"
    if not (decode(a[:split_a]).endswith(CANONICAL_REPLIES[0]) and decode(b[:split_b]).endswith(CANONICAL_REPLIES[1])):
        return "no_split_point"
    return a[split_a], a[split_a + 1:]
