"""The proxy under hostile and careless clients (issue #30), over real HTTP on 127.0.0.1.

Memory kept for refused prompts, slow and oversized requests, fields honoured or refused by name, stop
strings (the recorded ids are the sampled ones), the bytes of byte tokens, tiny temperatures, and a 500 that
costs only its own request (the connection stays, and the env worker's client retries a dropped connection).
"""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from actors.env_worker import retrying_transport
from rlsys.proxy.server import ProxyServer, _ChatCodec
from rlsys.proxy.sessions import SessionRecorder
from tests.unit.test_proxy_server import (  # noqa: F401 (fixtures)
    BOARD,
    MODEL,
    TOKEN,
    TOOLS,
    ScriptedEngine,
    auth,
    greedy_real_engine_app,
    make_app,
    model_dir,
    rlsys_ext,
    run,
    serving,
    tokenizer,
)

GOOD = {"model": MODEL, "messages": BOARD}


def chat(client: httpx.AsyncClient, body: dict, **headers):
    return client.post("/v1/chat/completions", headers={**auth(), **headers}, json=body)


# ---- 1. The render cache: bounded by bytes, never holding refused prompts --------------------------------------


def test_render_cache_is_bounded_by_bytes_and_keeps_no_prompt_that_leaves_no_room(tokenizer):
    codec = _ChatCodec(tokenizer, cache_size=1000, cache_bytes=60_000, max_prompt_tokens=400)
    for i in range(40):  # ~2.7 KB of key + ids each (~330 tokens): 40 of them are twice the budget
        codec.render([{"role": "user", "content": f"{i} " + "the " * 300}], None)
        assert codec.cached_bytes <= 60_000
    assert 0 < len(codec._rendered) < 40
    before = (dict(codec._rendered), codec.cached_bytes)
    too_long = [{"role": "user", "content": "word " * 1000}]  # > 400 tokens: the request will refuse it
    assert len(codec.render(too_long, None)) > 400
    assert (dict(codec._rendered), codec.cached_bytes) == before, "a refused prompt was cached"
    kept = [{"role": "user", "content": "39 " + "the " * 300}]
    hits = codec.cache_hits
    assert codec.render(kept, None) == codec._render(kept, None) and codec.cache_hits == hits + 1


def test_distinct_over_long_conversations_are_refused_without_growing_the_cache(tokenizer):
    engine = ScriptedEngine(tokenizer, ["ok"])
    app = make_app(tokenizer, engine, max_model_len=256)

    async def scenario():
        async with serving(app) as (_, _c, http):
            await chat(http, GOOD)  # a short one is cached
            cached = app.state.codec.cached_bytes
            for i in range(8):
                long = [{"role": "user", "content": f"{i} " + "tool output " * 2000}]
                r = await chat(http, {"model": MODEL, "messages": long})
                assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
            return cached, app.state.codec.cached_bytes

    before, after = run(scenario)
    assert 0 < before == after
    assert len(engine.calls) == 1


# ---- 2. Slow and oversized requests ------------------------------------------------------------------------


async def _read_until_closed(reader: asyncio.StreamReader, limit_s: float) -> bytes:
    """What the server sent before closing (a reset after the answer counts as the close)."""
    data = b""
    async with asyncio.timeout(limit_s):
        try:
            while chunk := await reader.read(65536):
                data += chunk
        except ConnectionError:
            pass
    return data


async def _send_slowly(writer: asyncio.StreamWriter, data: bytes, pause_s: float) -> None:
    try:
        for i in range(len(data)):
            writer.write(data[i:i + 1])
            await writer.drain()
            await asyncio.sleep(pause_s)
    except ConnectionError:
        pass  # the server closed: what it should do


@pytest.mark.parametrize("http_impl", ["httptools", "h11"])
def test_slow_clients_get_408_and_are_disconnected_while_others_are_served(tokenizer, http_impl):
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
    body = json.dumps(GOOD).encode()

    async def slow(port: int, kind: str) -> tuple[bytes, float]:
        loop = asyncio.get_running_loop()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        t0 = loop.time()
        sending = None
        if kind == "trickled_head":  # one byte every 0.2 s: the 1 s deadline passes long before the head ends
            sending = asyncio.create_task(_send_slowly(writer, head.encode(), 0.2))
        elif kind == "partial_body":
            writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body[:10])
        data = await _read_until_closed(reader, 10)
        elapsed = loop.time() - t0
        if sending is not None:
            sending.cancel()
        writer.close()
        return data, elapsed

    async def scenario():
        app = make_app(tokenizer, ScriptedEngine(tokenizer, ["hi"]))
        async with ProxyServer(app, http=http_impl, read_timeout_s=1.0) as server:
            results = await asyncio.gather(*[slow(server.port, kind) for kind in
                                             ("silent", "trickled_head", "partial_body") * 3])
            async with httpx.AsyncClient(base_url=server.url.removesuffix("/v1")) as http:
                good = await chat(http, GOOD)
        return results, good

    results, good = run(scenario)
    for data, elapsed in results:
        assert elapsed < 4, f"a slow connection was held {elapsed:.1f} s with a 1 s read timeout"
        assert data.startswith(b"HTTP/1.1 408") and b"request_timeout" in data, data[:200]
    assert good.status_code == 200


def test_read_timeout_leaves_idle_kept_connections_and_slow_apps_alone(tokenizer):
    """The deadline covers the client sending its request, not the time between requests or the engine's time."""
    engine = ScriptedEngine(tokenizer, ["hi"])

    async def scenario():
        async with ProxyServer(make_app(tokenizer, engine), read_timeout_s=0.5) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            request = f"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode()
            answers = []
            for pause in (0.0, 1.5):
                await asyncio.sleep(pause)
                writer.write(request)
                await writer.drain()
                answers.append(await asyncio.wait_for(reader.read(4096), 5))
            writer.close()
            engine.delay_s = 1.5  # generation slower than the read timeout
            async with httpx.AsyncClient(base_url=server.url.removesuffix("/v1")) as http:
                slow_app = await chat(http, GOOD)
        return answers, slow_app

    answers, slow_app = run(scenario)
    assert all(a.startswith(b"HTTP/1.1 200") for a in answers), answers
    assert slow_app.status_code == 200


@pytest.mark.parametrize("http_impl", ["httptools", "h11"])
@pytest.mark.parametrize("token", [None, TOKEN])
def test_oversized_headers_are_431_before_the_token_is_checked(tokenizer, http_impl, token):
    """~1 MB of headers sent in 1 KB lines: the server answers 431 once 16 KB are in, whoever sends them."""
    async def scenario():
        app = make_app(tokenizer, ScriptedEngine(tokenizer, ["hi"]))
        async with ProxyServer(app, http=http_impl, max_header_bytes=16_384) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            lines = [f"X-Pad-{i}: {'a' * 1000}\r\n" for i in range(1000)]
            if token:
                lines.insert(0, f"Authorization: Bearer {token}\r\n")
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            try:
                for line in lines:
                    writer.write(line.encode())
                    await writer.drain()
            except ConnectionError:
                pass
            data = await _read_until_closed(reader, 10)
            writer.close()
            async with httpx.AsyncClient(base_url=server.url.removesuffix("/v1")) as http:
                after = await http.get("/health", headers=auth())
            return data, after

    data, after = run(scenario)
    assert data.startswith(b"HTTP/1.1 431") and b"headers_too_large" in data, data[:300]
    assert after.status_code == 200


def test_headers_over_the_limit_in_one_read_are_431_from_the_guard(tokenizer):
    async def scenario():
        app = make_app(tokenizer, ScriptedEngine(tokenizer, ["hi"]), max_header_bytes=4096)
        async with serving(app) as (_, _c, http):
            return await http.get("/health", headers={"X-Pad": "a" * 8000})  # no token either

    r = run(scenario)
    assert r.status_code == 431 and r.json()["error"]["code"] == "headers_too_large"


# ---- 3. Every field honoured or refused by name ------------------------------------------------------------

REFUSED = [
    ({"response_format": {"type": "json_object"}}, "response_format", "text"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "text"),
    ({"parallel_tool_calls": False, "tools": TOOLS}, "parallel_tool_calls", "every call"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions", "use tools"),
    ({"function_call": "auto"}, "function_call", "use tools"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream is true"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation",
     "not supported"),
    ({"stream": True, "stream_options": {"chunk_size": 4}}, "stream_options.chunk_size", "unknown or unsupported"),
    ({"service_tier": "auto"}, "service_tier", "unknown or unsupported"),
    ({"top_k": 5}, "top_k", "unknown or unsupported"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "not a token id"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias", "below 1024"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"frequency_penalty": 2.5}, "frequency_penalty", "less than or equal"),
    ({"presence_penalty": -3}, "presence_penalty", "greater than or equal"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"stop": ["a", ""]}, "stop", "non-empty"),
    ({"metadata": {"k": 1}}, "metadata.k", "string"),
]


@pytest.mark.parametrize("extra,param,phrase", REFUSED, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(REFUSED)])
def test_unsupported_fields_are_400_naming_the_field(tokenizer, extra, param, phrase):
    engine = ScriptedEngine(tokenizer, ["hi"])

    async def scenario():
        async with serving(make_app(tokenizer, engine)) as (_, _c, http):
            return await chat(http, {**GOOD, **extra})

    r = run(scenario)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and phrase in err["message"], err
    assert engine.calls == []


def test_honoured_and_metadata_fields_reach_the_engine_or_are_accepted(tokenizer):
    engine = ScriptedEngine(tokenizer, ["hi"])

    async def scenario():
        async with serving(make_app(tokenizer, engine)) as (_, client, _h):
            await client.chat.completions.create(
                model=MODEL, messages=BOARD, frequency_penalty=0.5, presence_penalty=-0.25,
                logit_bias={"7": 3, "12": -100}, stop=["\n\n", "END"], user="agent-7", metadata={"run": "r1"},
                store=False, response_format={"type": "text"}, parallel_tool_calls=True, tools=TOOLS,
                temperature=1e-38)
            developer = [{"role": "developer", "content": "You play X."}, BOARD[1]]
            await client.chat.completions.create(model=MODEL, messages=developer)
            await client.chat.completions.create(model=MODEL, messages=BOARD, stop="END")

    run(scenario)
    (_, p), (developer_prompt, _), (_, single) = engine.calls
    assert (p.frequency_penalty, p.presence_penalty) == (0.5, -0.25)
    assert p.logit_bias == ((7, 3.0), (12, -100.0)) and p.stop == ("\n\n", "END") and single.stop == ("END",)
    assert p.temperature == 0.0, "a temperature of 1e-38 is greedy"
    assert developer_prompt == tokenizer.apply_chat_template(BOARD, add_generation_prompt=True, tokenize=True,
                                                             return_dict=False)


# ---- 4. Stop strings: the text ends before the string, the recorded ids are every sampled one ---------------


def test_stop_string_cuts_the_text_and_the_session_keeps_the_sampled_ids(tokenizer):
    """The reply's text stops before the string; the turn keeps every sampled id, and the agent's next turn,
    the reply sent back as returned, is built from those ids: one segment of exactly the sampled tokens."""
    sampled_text = "I pick 5.\nObservation: the board"
    engine = ScriptedEngine(tokenizer, [sampled_text], finish_reason="length")  # no end-of-turn token
    recorder = SessionRecorder()
    session = {"X-Rlsys-Session": "s"}

    async def scenario():
        async with serving(make_app(tokenizer, engine, recorder)) as (_, client, _h):
            first = await client.chat.completions.create(model=MODEL, messages=BOARD, stop=["Observation:"],
                                                         extra_headers=session)
            history = BOARD + [first.choices[0].message.model_dump(exclude_none=True),
                               {"role": "user", "content": "Observation: X at 5."}]
            second = await client.chat.completions.create(model=MODEL, messages=history, stop="Observation:",
                                                          extra_headers=session)
            return first, second

    first, second = run(scenario)
    assert first.choices[0].message.content == "I pick 5.\n"
    sampled = tokenizer.encode(sampled_text, add_special_tokens=False)
    assert rlsys_ext(first)["completion_ids"] == sampled
    assert rlsys_ext(second)["prompt_source"] == "prompt_from_ids"
    record = recorder.pop("s")
    assert record.num_turns == 2 and record.segment_breaks == 0
    (seg,) = record.segments
    assert [t for t, m in zip(seg.input_ids, seg.loss_mask) if m] == sampled + rlsys_ext(second)["completion_ids"]


def test_stop_string_on_the_real_engine_trains_on_exactly_the_sampled_tokens(model_dir, tokenizer):
    """Greedy, once without a stop string and once with a piece of that text as one: the second sample is the
    first one's tokens up to the token completing the string, and those are what the session records."""
    recorder = SessionRecorder()
    engine, app = greedy_real_engine_app(model_dir, tokenizer, recorder, 24, batch_wait_s=0)

    async def scenario():
        try:
            async with serving(app) as (_, client, _h):
                free = await client.chat.completions.create(model=MODEL, messages=BOARD)
                ids = rlsys_ext(free)["completion_ids"]
                full = tokenizer.decode(ids[:12])
                stop = full[len(tokenizer.decode(ids[:6])):][:3]  # text that starts within the 7th token
                stopped = await client.chat.completions.create(model=MODEL, messages=BOARD, stop=[stop],
                                                               extra_headers={"X-Rlsys-Session": "st"})
                return ids, stop, stopped
        finally:
            await engine.shutdown()

    ids, stop, stopped = run(scenario)
    assert stop, "the untrained model's greedy text is too short for this test"
    got = rlsys_ext(stopped)["completion_ids"]
    assert got == ids[:len(got)] and len(got) < len(ids)
    assert stop in tokenizer.decode(got) and stop not in tokenizer.decode(got[:-1])
    assert stopped.choices[0].finish_reason == "stop" and stop not in stopped.choices[0].message.content
    (seg,) = recorder.pop("st").segments
    assert [t for t, m in zip(seg.input_ids, seg.loss_mask) if m] == got
    assert [lp for lp, m in zip(seg.rollout_logprobs, seg.loss_mask) if m] == rlsys_ext(stopped)["logprobs"]


# ---- 5. Bytes of byte tokens, tiny temperatures ---------------------------------------------------------


def test_logprob_bytes_of_byte_tokens_inside_multibyte_characters(tokenizer):
    text = "Hi \U0001f642 é 中 ok"
    engine = ScriptedEngine(tokenizer, [text])

    async def scenario():
        async with serving(make_app(tokenizer, engine)) as (_, client, _h):
            return await client.chat.completions.create(model=MODEL, messages=BOARD, logprobs=True)

    entries = run(scenario).choices[0].logprobs.content
    assert any(e.token == "\ufffd" for e in entries), "the text should have byte tokens for this test"
    assert b"".join(bytes(e.bytes) for e in entries) == text.encode("utf-8")
    assert all(list(e.bytes) != list("\ufffd".encode()) for e in entries)


# ---- 6. A 500 costs only its own request -------------------------------------------------------------------


class BrokenRecorder(SessionRecorder):
    """A recorder with a bug on its first turn: what reaches the proxy's catch-all."""

    def __init__(self) -> None:
        super().__init__()
        self.broken = True

    def record(self, *args, **kwargs):
        if self.broken:
            self.broken = False
            raise KeyError("a bug in the proxy")
        return super().record(*args, **kwargs)


def test_an_unexpected_error_is_a_json_500_on_a_connection_that_stays_open(tokenizer):
    app = make_app(tokenizer, ScriptedEngine(tokenizer, ["hi"]), BrokenRecorder())
    body = json.dumps(GOOD).encode()
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
               f"X-Rlsys-Session: s\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
               ).encode() + body

    async def exchange(reader, writer) -> tuple[int, dict, dict]:
        writer.write(request)
        await writer.drain()
        head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).decode().lower()
        length = int(head.split("content-length: ")[1].split("\r\n")[0])
        payload = json.loads(await asyncio.wait_for(reader.readexactly(length), 10))
        return int(head.split()[1]), payload, head

    async def scenario():
        async with ProxyServer(app) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            first = await exchange(reader, writer)
            second = await exchange(reader, writer)  # the same connection
            writer.close()
            return first, second

    (status1, body1, head1), (status2, body2, _) = run(scenario)
    assert status1 == 500 and body1["error"]["type"] == "server_error" and "KeyError" in body1["error"]["message"]
    assert "connection: close" not in head1
    assert status2 == 200 and body2["object"] == "chat.completion"


def test_env_worker_client_retries_a_connection_the_server_dropped_before_answering(tokenizer):
    """The first connection is closed by the server before any answer (a kept-alive connection it had just
    closed): the env worker's transport sends the request again on a new one; a client without it loses it."""
    app = make_app(tokenizer, ScriptedEngine(tokenizer, ["hi"]))

    async def scenario():
        async with ProxyServer(app) as server:
            drops = {"left": 0}

            async def front(reader, writer):  # 127.0.0.1 relay to the proxy that drops connections on command
                if drops["left"]:
                    drops["left"] -= 1
                    await reader.read(1)
                    writer.close()
                    return
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", server.port)

                async def pipe(src, dst):
                    while data := await src.read(65536):
                        dst.write(data)
                        await dst.drain()
                    dst.close()

                await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True)

            relay = await asyncio.start_server(front, "127.0.0.1", 0)
            url = f"http://127.0.0.1:{relay.sockets[0].getsockname()[1]}/v1"
            limits = httpx.Limits(max_connections=8, max_keepalive_connections=8)
            results = {}
            for name, transport in (("retrying", retrying_transport(limits)), ("plain", None)):
                async with httpx.AsyncClient(transport=transport, timeout=10) as http:
                    client = openai.AsyncOpenAI(base_url=url, api_key=TOKEN, max_retries=0, http_client=http)
                    drops["left"] = 1
                    try:
                        resp = await client.chat.completions.create(model=MODEL, messages=BOARD)
                        results[name] = resp.choices[0].message.content
                    except openai.APIConnectionError as err:
                        results[name] = err
            relay.close()
            return results

    results = run(scenario)
    assert results["retrying"] == "hi"
    assert isinstance(results["plain"], openai.APIConnectionError), "the relay did not drop the connection"
