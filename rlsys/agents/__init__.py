"""Helpers for agents written with other frameworks (docs/agents.md).

An rlsys agent is `async def agent(item, client, model)`; `client` is an `openai.AsyncOpenAI` that the env worker
points at the rollout proxy, with the episode's session headers (`X-Rlsys-Session`, `X-Rlsys-Attempt`) in its
default headers and the worker's shared HTTP pool (it retries a request whose connection failed before any
response, actors/env_worker.py). A framework that takes an `AsyncOpenAI` (the OpenAI Agents SDK) gets `client`
itself. One that builds its own client from settings (LangChain's `ChatOpenAI`) gets `openai_kwargs(client)`:
the same URL, key, headers, HTTP pool and no retries, so its requests land in the same proxy session.

No framework is imported here: `import rlsys` stays free of them.
"""
from __future__ import annotations

from typing import Any

RLSYS_HEADER_PREFIX = "x-rlsys-"


def session_headers(client: Any) -> dict[str, str]:
    """The rlsys headers of `client` (session, attempt): what identifies the episode to the proxy.

    `client.default_headers` also holds the client's own headers (Authorization, User-Agent, X-Stainless-*);
    a framework's client adds its own, so only ours are passed on."""
    return {k: v for k, v in client.default_headers.items() if k.lower().startswith(RLSYS_HEADER_PREFIX)}


def openai_kwargs(client: Any) -> dict[str, Any]:
    """Keyword arguments that make another OpenAI-compatible client talk to the same proxy session as
    `client`: `base_url`, `api_key`, `default_headers` (the session headers), `http_async_client` (the
    worker's pool; `client._client`, the openai SDK's documented `http_client` as stored) and `max_retries=0`
    (a retried request after an HTTP error could record a turn twice). The names are `ChatOpenAI`'s."""
    return {"base_url": str(client.base_url), "api_key": client.api_key, "default_headers": session_headers(client),
            "http_async_client": client._client, "max_retries": 0}
