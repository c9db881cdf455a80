"""``stream=True``: a chat completion sent as server-sent events in OpenAI's ``chat.completion.chunk`` format.

Neither engine streams tokens (``Engine.generate`` returns the whole completion), so this is not token-by-token
streaming: the response starts (status 200, the role chunk) as soon as the request is accepted, and the
completion follows in pieces once the engine has finished it:

1. ``{"delta": {"role": "assistant"}}``, sent before generation; ``: keep-alive`` comments every
   ``KEEPALIVE_S`` while the engine works, so that a client's read timeout sees bytes;
2. the content in ``PIECE_CHARS`` pieces; with ``logprobs=true`` the token entries ride on those chunks, split in
   order, so that their concatenation is the non-streamed ``choices[0].logprobs.content``;
3. each tool call as OpenAI's deltas: ``{index, id, type, function: {name, arguments: ""}}``, then the arguments
   in pieces ``{index, function: {arguments}}``;
4. ``finish_reason`` (and the ``rlsys`` extension of the non-streamed body) on the last of these chunks;
5. with ``stream_options.include_usage``: a chunk with ``choices: []`` and ``usage`` (``usage: null`` on the
   others, as OpenAI sends), then ``data: [DONE]``.

An engine failure after the stream started ends it with ``data: {"error": {...}}`` (what the openai client raises
as ``APIError``) and no ``[DONE]``. Errors found before (validation, context length) are ordinary JSON errors.
Generation and the session recording run in a task of their own (server.py): a client that disconnects
mid-stream cancels this generator, not the task, so the turn is recorded as for a non-streamed request.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from rlsys.proxy.serving import error_body

logger = logging.getLogger(__name__)

PIECE_CHARS = 16  # characters of content (or of tool-call arguments) per chunk
KEEPALIVE_S = 15.0  # an SSE comment this often while the engine generates


class EngineError(Exception):
    """The engine failed this request (its message is the error's text)."""


def _event(payload: Any) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


def _pieces(text: str) -> list[str]:
    return [text[i:i + PIECE_CHARS] for i in range(0, len(text), PIECE_CHARS)]


def completion_chunks(body: dict[str, Any], base: dict[str, Any]) -> list[dict[str, Any]]:
    """The non-streamed ``body`` as the chunks after the role chunk (usage chunk excluded). ``base``: the fields
    every chunk of this stream carries (id, object, created, model, ...)."""
    choice = body["choices"][0]
    message = choice["message"]
    deltas: list[tuple[dict[str, Any], dict[str, Any] | None]] = []  # (delta, logprobs)

    content = message["content"]
    texts = ([""] if content == "" else _pieces(content)) if content is not None else []
    entries = choice["logprobs"]["content"] if choice["logprobs"] is not None else None
    n = max(len(texts), 0 if entries is None else 1)
    for k in range(n):
        logprobs = None
        if entries is not None:  # contiguous groups, one per chunk, in order
            lo, hi = len(entries) * k // n, len(entries) * (k + 1) // n
            logprobs = {"content": entries[lo:hi], "refusal": None}
        deltas.append(({"content": texts[k]} if k < len(texts) else {}, logprobs))

    for index, call in enumerate(message.get("tool_calls") or []):
        head = {"index": index, "id": call["id"], "type": "function",
                "function": {"name": call["function"]["name"], "arguments": ""}}
        deltas.append(({"tool_calls": [head]}, None))
        for piece in _pieces(call["function"]["arguments"]):
            deltas.append(({"tool_calls": [{"index": index, "function": {"arguments": piece}}]}, None))

    if not deltas:
        deltas.append(({}, None))
    chunks = [{**base, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": None}]}
              for delta, logprobs in deltas]
    chunks[-1]["choices"][0]["finish_reason"] = choice["finish_reason"]
    chunks[-1]["rlsys"] = body["rlsys"]
    return chunks


async def sse_events(completion: asyncio.Future, base: dict[str, Any], include_usage: bool) -> AsyncIterator[bytes]:
    """The stream of one request whose ``completion`` (a task: the non-streamed body, or ``EngineError``) runs
    on its own. ``base``: id, object, created, model, system_fingerprint (and ``usage: None`` when asked)."""
    yield _event({**base, "choices": [{"index": 0, "delta": {"role": "assistant"}, "logprobs": None,
                                       "finish_reason": None}]})
    while not completion.done():  # asyncio.wait, unlike wait_for, never cancels the task
        await asyncio.wait({completion}, timeout=KEEPALIVE_S)
        if not completion.done():
            yield b": keep-alive\n\n"
    try:
        body = completion.result()
    except EngineError as err:
        yield _event(error_body(str(err), "server_error"))
        return
    except Exception as exc:  # a bug in the proxy: the headers are out, so it can only end the stream
        logger.exception("unexpected error in a streamed chat completion")
        yield _event(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"))
        return
    for chunk in completion_chunks(body, base):
        yield _event(chunk)
    if include_usage:
        yield _event({**base, "choices": [], "usage": body["usage"]})
    yield b"data: [DONE]\n\n"
