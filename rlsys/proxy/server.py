"""The OpenAI-compatible chat-completions proxy that agents talk to during rollouts.

One request: validate (schema.py) -> chat template with ``tools`` -> prompt token ids -> engine ->
completion ids + logprobs -> tool-call parser (toolcalls.py) -> an OpenAI ``ChatCompletion`` with an
extension field ``"rlsys"`` carrying ``prompt_ids``, ``completion_ids``, ``logprobs``,
``tool_call_errors`` and ``session_id``. With an ``X-Rlsys-Session`` header the turn is also recorded
server-side (sessions.py), so the learner trains on the tokens actually sampled; an ``X-Rlsys-Attempt``
header names the env worker's run of the episode (a retried episode starts a new life of the session).

Routes: ``POST /v1/chat/completions`` (``stream=True``: server-sent events after generation, streaming.py), ``GET /v1/models[/{id}]``, ``GET /health``. The HTTP
layer (serving.py) stands in front: head size (431), bearer token on every path (401), body size (413), read
deadline (408), and a JSON 500 on a connection that stays open for an engine failure or a bug in the proxy.
FastAPI's docs and OpenAPI routes are disabled. Client errors are 400 (or 401/404/405/408/413/431) with
OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``; the server keeps serving.

Hostile and careless clients (issue #30; the HTTP side is in serving.py):
- Rendered prompts are cached by bytes (``RENDER_CACHE_BYTES``) as well as by count, and a prompt that
  leaves no room to generate (refused with ``context_length_exceeded``) is never cached: each distinct
  over-long conversation used to pin ~15 MB of key and ids.
- Every request field is honoured or refused with a 400 naming it (schema.py); stop strings end the text
  before the string while the recorded ids keep every sampled token, up to the one that completed it.

Choices worth knowing:
- Within a session, a request that repeats the previous request's messages, then the assistant
  message as returned, then new messages, gets its prompt from ids: previous prompt + sampled ids +
  the template's tokens for the new messages (continuation.py), so sampled text that would not
  re-render the same (a bare JSON call, compact JSON) does not break the segment. Other requests get
  the full render; which path was taken is counted per session and returned as
  ``rlsys.prompt_source``.
- The prompt is rendered with ``tokenize=True, return_dict=False`` (transformers 5 returns a
  ``BatchEncoding`` by default) and control tokens in message text are *not* sanitised: on the
  full-render path, text that the model sampled (a malformed ``<tool_call>`` left in content, say)
  must re-tokenise to the same ids, or the session's segment breaks. The agent is the user's own
  trusted code.
- ``max_tokens`` / ``max_completion_tokens`` are clipped to ``max_tokens_cap`` and to the room left in
  ``max_model_len`` after the prompt (a prompt that leaves no room is a 400), so long multi-turn
  episodes end with ``finish_reason="length"`` instead of an error.
- Generation always stops at ``<|im_end|>`` / ``<|endoftext|>`` (when the vocabulary has them) and
  the tokenizer's eos; the stop token stays in ``completion_ids`` (it was sampled and is trained on)
  but not in the message text.
- Without ``tools`` (or with ``tool_choice="none"``) the text is returned as content, unparsed. With
  tools and no parsed call, content is the raw text, unstripped, so that re-rendering the history
  reproduces the sampled tokens where it can.
- Sampling seeds of session requests that name none come from ``seed_for_session(session_id, index)``
  with the request's index in the session taken at arrival (sessions.py ``begin``): concurrent
  requests of one session get distinct seeds.

``ProxyServer`` (serving.py, re-exported here) runs uvicorn as a task inside the caller's running event loop.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import re
import sys
import time
import uuid
from array import array
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from rlsys.engines.base import GREEDY_BELOW, Engine, GenerateOutput, SamplingParams
from rlsys.proxy.continuation import (
    FIRST,
    RE_RENDERED,
    Exchange,
    PromptPlan,
    message_keys,
    plan_prompt,
    reply_key,
    tools_key,
)
from rlsys.proxy.schema import (
    ChatCompletionRequest,
    RequestError,
    check_request,
    format_validation_error,
    loads_json,
    logit_bias,
    stop_strings,
    template_messages,
    template_tools,
    tool_names,
)
from rlsys.proxy.serving import MAX_HEADER_BYTES, ProxyServer, _GuardMiddleware, error_body
from rlsys.proxy.sessions import ATTEMPT_HEADER, SESSION_HEADER, RequestTicket, SessionRecorder
from rlsys.proxy.streaming import EngineError, sse_events
from rlsys.proxy.toolcalls import parse_tool_calls, to_openai_tool_calls
from rlsys.types import Turn

__all__ = ["ProxyServer", "create_app", "END_OF_TURN_TOKENS", "RENDER_CACHE_SIZE", "RENDER_CACHE_BYTES"]
logger = logging.getLogger(__name__)

MAX_SESSION_ID_CHARS = 256
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>")
RENDER_CACHE_SIZE = 1024  # conversations whose prompt ids the proxy keeps (a step's distinct prompts, and more)
RENDER_CACHE_BYTES = 64 * 2**20  # ...and at most this many bytes of keys and ids (long agent histories are MBs)


# ---- Errors -------------------------------------------------------------------------------------


def _error_response(status: int, message: str, type_: str = "invalid_request_error",
                    param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


def _request_error_response(err: RequestError) -> JSONResponse:
    return _error_response(err.status, str(err), "invalid_request_error", err.param, err.code)


# ---- Prompt rendering and completion decoding ----------------------------------------------------


class _ChatCodec:
    """Chat template -> prompt ids, and completion ids -> text, for one tokenizer."""

    def __init__(self, tokenizer: Any, cache_size: int = RENDER_CACHE_SIZE, *, cache_bytes: int = RENDER_CACHE_BYTES,
                 max_prompt_tokens: int | None = None) -> None:
        """``max_prompt_tokens``: the longest prompt that leaves room to generate; longer ones are refused
        by the request and so never cached."""
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        end_ids = {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab}
        eos = tokenizer.eos_token_id
        end_ids.update([eos] if isinstance(eos, int) else (eos or []))
        self.end_ids: frozenset[int] = frozenset(end_ids)
        # LRU: conversation JSON -> (prompt ids, the entry's bytes); ids as a 4-byte array, not ~36-byte ints
        self._rendered: OrderedDict[str, tuple[array, int]] = OrderedDict()
        self._cache_size = cache_size
        self._cache_bytes = cache_bytes
        self.max_prompt_tokens = max_prompt_tokens
        self.cached_bytes = 0
        self.cache_hits = 0

    def render(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """Prompt ids of a conversation. The n samples of a group send the same conversation n times, and the
        template + tokenizer are most of the proxy's CPU time per request (the event loop it shares with the
        engine's output handling), so renders are kept in a small LRU keyed by the conversation's JSON, bounded
        by entries and by bytes."""
        if not self._cache_size or not self._cache_bytes:
            return self._render(messages, tools)
        key = json.dumps([messages, tools], sort_keys=True, ensure_ascii=False, default=str)
        hit = self._rendered.get(key)
        if hit is not None:
            self._rendered.move_to_end(key)
            self.cache_hits += 1
            return hit[0].tolist()
        ids = self._render(messages, tools)
        self._remember(key, ids)
        return ids

    def _remember(self, key: str, ids: list[int]) -> None:
        if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
            return  # refused with context_length_exceeded: nobody will get these ids
        packed = array("i", ids)
        cost = sys.getsizeof(key) + sys.getsizeof(packed)
        if cost > self._cache_bytes:
            return
        self._rendered[key] = (packed, cost)
        self.cached_bytes += cost
        while len(self._rendered) > self._cache_size or self.cached_bytes > self._cache_bytes:
            self.cached_bytes -= self._rendered.popitem(last=False)[1][1]

    def _render(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        try:
            out = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        # What a chat template raises on input it cannot render (raise_exception() in Qwen's
        # templates, undefined fields, type errors in its expressions, deep tool schemas in tojson).
        except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError, RecursionError) as exc:
            logger.info("chat template refused a request: %s: %s", type(exc).__name__, exc)
            raise RequestError("messages", f"the chat template cannot render this conversation: "
                                           f"{type(exc).__name__}: {exc}") from exc
        if isinstance(out, Mapping):  # a BatchEncoding, should a tokenizer ignore return_dict
            out = out["input_ids"]
        return [int(t) for t in out]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def text_of(self, completion_ids: list[int], stop: tuple[str, ...] = ()) -> str:
        """The message text: the ids decoded with special tokens, minus a trailing end-of-turn token, and cut
        before the first stop string (the engine stopped at the token that completed it)."""
        ids = completion_ids[:-1] if completion_ids and completion_ids[-1] in self.end_ids else completion_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
        return text[:min(cuts)] if cuts else text

    def token_logprobs(self, completion_ids: list[int], logprobs: list[float]) -> dict[str, Any]:
        """OpenAI ``choices[].logprobs``: one entry per token of the message text."""
        n = len(completion_ids) - (1 if completion_ids and completion_ids[-1] in self.end_ids else 0)
        entries = []
        for tid, lp in zip(completion_ids[:n], logprobs[:n]):
            token = self.tokenizer.decode([tid], skip_special_tokens=False)
            entries.append({"token": token, "logprob": lp, "bytes": list(self._token_bytes(tid, token)),
                            "top_logprobs": []})
        return {"content": entries, "refusal": None}

    def _token_bytes(self, tid: int, text: str) -> bytes:
        """The token's own bytes. A token holding part of a multi-byte character decodes to U+FFFD; its bytes
        are then read from the vocabulary entry: byte-level BPE's printable stand-ins for bytes (GPT-2,
        Qwen) or a sentencepiece byte-fallback piece ``<0xE2>``."""
        if "\ufffd" not in text:
            return text.encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(tid)
        fallback = _BYTE_PIECE.fullmatch(piece)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        if all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        return text.encode("utf-8")


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's map from a vocabulary character back to its byte (GPT-2's ``bytes_to_unicode``
    inverted): printable Latin-1 bytes stand for themselves, the others for 256 + their rank."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    out = {chr(b): b for b in printable}
    extra = [b for b in range(256) if b not in out.values()]
    out.update({chr(256 + i): b for i, b in enumerate(extra)})
    return out


_BYTE_OF_CHAR = _byte_level_alphabet()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


# ---- The app ------------------------------------------------------------------------------------


def create_app(
    engine: Engine,
    tokenizer: Any,
    *,
    api_token: str,
    model_name: str,
    sampling_defaults: SamplingParams | Callable[[], SamplingParams],
    recorder: SessionRecorder,
    max_request_bytes: int = 1_000_000,
    max_tokens_cap: int = 4096,
    max_model_len: int | None = None,
    seed_for_session: Callable[[str, int], int] | None = None,
    render_cache_size: int = RENDER_CACHE_SIZE,
    render_cache_bytes: int = RENDER_CACHE_BYTES,
    max_header_bytes: int = MAX_HEADER_BYTES,
) -> FastAPI:
    """The proxy's ASGI app. ``max_model_len`` (prompt + completion) defaults to the engine's
    ``max_model_len`` attribute when it has one, else to ``tokenizer.model_max_length`` when that is
    a real bound (< 10**9); ``None`` there means no prompt-length check.

    ``seed_for_session(session_id, index)`` gives the sampling seed of a session request that names
    none, ``index`` being the request's place in the session in arrival order (0, 1, ...): a sequential
    agent's samples depend on the job's seed and session ids, not on how requests of different
    sessions interleave, and concurrent requests of one session still get distinct seeds."""
    if not api_token:
        raise ValueError("api_token must be a non-empty string")
    if max_tokens_cap < 1:
        raise ValueError(f"max_tokens_cap must be >= 1, got {max_tokens_cap}")
    if max_model_len is None:
        max_model_len = getattr(engine, "max_model_len", None)
    if max_model_len is None and getattr(tokenizer, "model_max_length", 10**30) < 10**9:
        max_model_len = int(tokenizer.model_max_length)
    codec = _ChatCodec(tokenizer, render_cache_size, cache_bytes=render_cache_bytes,
                       max_prompt_tokens=None if max_model_len is None else max_model_len - 1)
    vocab_size = len(tokenizer)  # logit_bias keys must be ids the engine knows
    # a callable is read per request: the rollout actor switches to greedy for evaluation and back
    current_defaults = sampling_defaults if callable(sampling_defaults) else (lambda: sampling_defaults)
    stop_ids = tuple(sorted(set(current_defaults().stop_token_ids) | codec.end_ids))
    created = int(time.time())

    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.state.codec = codec  # for metrics and tests: its cache's size (cached_bytes) and hits
    app.add_middleware(_GuardMiddleware, api_token=api_token, max_body=max_request_bytes,
                       max_header_bytes=max_header_bytes)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found" if exc.status_code == 404 else None
        return _error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=kind)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    model_card = {"id": model_name, "object": "model", "created": created, "owned_by": "rlsys"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        if model_id != model_name:
            return _error_response(404, f"model: the model {model_id!r} does not exist", param="model",
                                   code="model_not_found")
        return JSONResponse(model_card)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        try:
            req, session_id, attempt = _parse(await request.body(), request.headers, model_name)
            tools = template_tools(req)
            messages = template_messages(req)
            ticket = recorder.begin(session_id, attempt) if session_id is not None else None
            keys = message_keys(messages) if ticket is not None else ()
            plan = _plan_prompt(codec, messages, keys, tools, ticket)
            prompt_ids = plan.prompt_ids
            params = _sampling_params(req, current_defaults(), stop_ids, len(prompt_ids),
                                      max_tokens_cap, max_model_len, vocab_size)
            if params.seed is None and ticket is not None and seed_for_session is not None:
                params = dataclasses.replace(params, seed=seed_for_session(session_id, ticket.index))
        except RequestError as err:
            return _request_error_response(err)

        async def complete() -> dict[str, Any]:
            """Generate, build the body, record the session's turn: the same for a streamed request."""
            try:
                out = await engine.generate(prompt_ids, params)
                _check_output(out)
            except Exception as exc:  # an engine failure must not take the server down: log, 500, go on
                logger.exception("engine.generate failed on a %d-token prompt", len(prompt_ids))
                raise EngineError(f"engine error: {type(exc).__name__}: {exc}") from exc
            parse_names = tool_names(req) if tools is not None else None
            body = _completion_body(req, out, codec, prompt_ids, parse_names, session_id, model_name)
            body["rlsys"]["prompt_source"] = plan.source
            if ticket is not None:
                _record_turn(recorder, session_id, ticket, plan, keys, tools, prompt_ids, out, body)
            return body

        if req.stream:
            return _streaming_response(complete(), model_name, include_usage=bool(
                req.stream_options is not None and req.stream_options.include_usage))
        try:
            return JSONResponse(await complete())
        except EngineError as err:
            return _error_response(500, str(err), "server_error")

    return app


_in_flight: set[asyncio.Task] = set()  # streamed completions' tasks, referenced until done


def _streaming_response(completion: Coroutine[Any, Any, dict[str, Any]], model_name: str, *,
                        include_usage: bool) -> StreamingResponse:
    """Server-sent events (streaming.py). The completion runs as a task of its own: a client that disconnects
    mid-stream cancels the response, not the generation, so its turn is recorded as a non-streamed one's."""
    task = asyncio.ensure_future(completion)
    _in_flight.add(task)
    # the task's exception is the stream's error event; a stream cancelled first leaves it unread
    task.add_done_callback(lambda t: (_in_flight.discard(t), t.cancelled() or t.exception()))
    base: dict[str, Any] = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
                            "created": int(time.time()), "model": model_name, "system_fingerprint": None}
    if include_usage:
        base["usage"] = None  # on every chunk but the last, as OpenAI sends
    return StreamingResponse(sse_events(task, base, include_usage), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _record_turn(recorder: SessionRecorder, session_id: str, ticket: RequestTicket, plan: PromptPlan,
                 keys: tuple[str, ...], tools: list[dict] | None, prompt_ids: list[int], out: GenerateOutput,
                 body: dict[str, Any]) -> None:
    choice = body["choices"][0]
    exchange = Exchange(keys, tools_key(tools), prompt_ids, body["rlsys"]["completion_ids"],
                        _returned_reply(choice["message"]))
    # the engine's reason ("stop" | "length"): a cut-off answer can still carry a parsed call
    turn = Turn(prompt_ids, list(out.token_ids), list(out.logprobs), out.finish_reason)
    if not recorder.record(session_id, turn, ticket=ticket, source=plan.source, reason=plan.reason,
                           exchange=exchange):
        logger.info("session %.64s: turn %d not recorded (session popped while in flight, or over "
                    "the turn cap)", session_id, ticket.index)


def _plan_prompt(codec: _ChatCodec, messages: list[dict], keys: tuple[str, ...], tools: list[dict] | None,
                 ticket: RequestTicket | None) -> PromptPlan:
    """The prompt from ids when the request continues its session's previous one, else the full render."""
    if ticket is not None:
        plan = plan_prompt(ticket.previous, messages, keys, tools,
                           lambda m: codec.render(m, tools), codec.end_ids, codec.decode)
        if isinstance(plan, PromptPlan):
            return plan
        full = codec.render(messages, tools)
        return PromptPlan(full, FIRST) if plan == FIRST else PromptPlan(full, RE_RENDERED, plan)
    return PromptPlan(codec.render(messages, tools), FIRST)


def _returned_reply(message: dict[str, Any]) -> str:
    """reply_key() of the assistant message the proxy returns (arguments as the parser decoded them)."""
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []]
    return reply_key(message["content"], calls)


def _parse(raw: bytes, headers: Mapping[str, str], model_name: str
           ) -> tuple[ChatCompletionRequest, str | None, str | None]:
    try:
        data = loads_json(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise RequestError("body", f"not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise RequestError("body", f"must be a JSON object, got {type(data).__name__}")
    try:
        # Lone surrogates ("\ud800") decode from JSON but cannot be tokenised or sent back.
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError("body", f"contains text that is not valid Unicode: {exc.reason}") from exc
    try:
        req = ChatCompletionRequest.model_validate(data)
    except ValidationError as exc:
        raise format_validation_error(exc) from exc
    if req.model != model_name:
        raise RequestError("model", f"the model {req.model!r} does not exist; this server serves {model_name!r}",
                           status=404, code="model_not_found")
    check_request(req)
    session_id = headers.get(SESSION_HEADER)
    if session_id is not None and not 0 < len(session_id) <= MAX_SESSION_ID_CHARS:
        raise RequestError(SESSION_HEADER, f"must be 1 to {MAX_SESSION_ID_CHARS} characters")
    attempt = headers.get(ATTEMPT_HEADER)
    if attempt is not None and not 0 < len(attempt) <= MAX_SESSION_ID_CHARS:
        raise RequestError(ATTEMPT_HEADER, f"must be 1 to {MAX_SESSION_ID_CHARS} characters")
    return req, session_id, attempt


def _sampling_params(req: ChatCompletionRequest, defaults: SamplingParams, stop_ids: tuple[int, ...],
                     prompt_len: int, max_tokens_cap: int, max_model_len: int | None, vocab_size: int
                     ) -> SamplingParams:
    requested = req.max_completion_tokens or req.max_tokens or defaults.max_new_tokens
    max_new = min(requested, max_tokens_cap)
    if max_model_len is not None:
        room = max_model_len - prompt_len
        if room < 1:
            raise RequestError("messages", f"the prompt is {prompt_len} tokens; the model's context is "
                                           f"{max_model_len} tokens, which leaves no room to generate",
                               code="context_length_exceeded")  # OpenAI's code: agents can stop on it
        max_new = min(max_new, room)
    temperature = defaults.temperature if req.temperature is None else req.temperature
    return SamplingParams(
        max_new_tokens=max_new,
        # 1e-38 passed validation and made 1/T overflow into NaN probabilities: that close to 0 is greedy
        temperature=0.0 if temperature < GREEDY_BELOW else temperature,
        top_p=defaults.top_p if req.top_p is None else req.top_p,
        seed=defaults.seed if req.seed is None else req.seed,
        stop_token_ids=stop_ids,
        stop=stop_strings(req),
        frequency_penalty=req.frequency_penalty or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        logit_bias=logit_bias(req, vocab_size),
    )


def _check_output(out: GenerateOutput) -> None:
    """Refuse engine output the response or the learner could not use (raised as an engine error)."""
    if len(out.token_ids) != len(out.logprobs):
        raise RuntimeError(f"{len(out.token_ids)} token ids but {len(out.logprobs)} logprobs")
    if not all(math.isfinite(x) for x in out.logprobs):
        raise RuntimeError("non-finite logprob in the engine's output")


def _completion_body(req: ChatCompletionRequest, out: GenerateOutput, codec: _ChatCodec, prompt_ids: list[int],
                     parse_names: list[str] | None, session_id: str | None, model_name: str) -> dict[str, Any]:
    completion_ids = [int(t) for t in out.token_ids]
    logprobs = [float(x) for x in out.logprobs]
    text = codec.text_of(completion_ids, stop_strings(req))
    calls, errors, content = [], [], text
    if parse_names is not None:
        parsed = parse_tool_calls(text, parse_names)
        errors = [{"kind": e.kind, "message": e.message} for e in parsed.errors]
        if parsed.calls:
            calls = to_openai_tool_calls(parsed.calls, id_prefix=f"call_{uuid.uuid4().hex[:8]}_")
            content = parsed.content or None
    finish = "tool_calls" if calls else ("length" if out.finish_reason == "length" else "stop")
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if calls:
        message["tool_calls"] = calls
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [{
            "index": 0,
            "message": message,
            "finish_reason": finish,
            "logprobs": codec.token_logprobs(completion_ids, logprobs) if req.logprobs else None,
        }],
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(completion_ids),
                  "total_tokens": len(prompt_ids) + len(completion_ids)},
        "rlsys": {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs,
                  "tool_call_errors": errors, "session_id": session_id},
    }
