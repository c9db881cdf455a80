"""The proxy over real HTTP: uvicorn on 127.0.0.1, the official openai client, the tiny model's tokenizer.

Most tests drive a ``ScriptedEngine`` (fixed completion text -> token ids, known logprobs) so they test
the server's plumbing exactly; ``test_real_tiny_model_through_transformers_engine`` goes through the
real tiny model and ``TransformersEngine``.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from rlsys.engines.base import Engine, GenerateOutput, SamplingParams
from rlsys.models.tiny import ensure_tiny_model
from rlsys.proxy.server import ProxyServer, create_app
from rlsys.proxy.sessions import SessionRecorder

TOKEN = "test-token-0123456789"
MODEL = "tiny"
DEFAULTS = SamplingParams(max_new_tokens=32, temperature=1.0, top_p=1.0)
TOOLS = [{
    "type": "function",
    "function": {
        "name": "choose_square",
        "description": "Put an X on a square.",
        "parameters": {"type": "object", "properties": {"square": {"type": "integer"}}, "required": ["square"]},
    },
}]
CALL_BLOCK = '<tool_call>\n{"name": "choose_square", "arguments": {"square": 5}}\n</tool_call>'
BOARD = [{"role": "system", "content": "You play X."}, {"role": "user", "content": "Board: XO.X.O... Your move."}]


@pytest.fixture(scope="module")
def model_dir():
    return ensure_tiny_model()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


class ScriptedEngine(Engine):
    """Answers each generate() with the next scripted text (cycling), encoded + <|im_end|>."""

    def __init__(self, tokenizer: Any, texts: list[str], finish_reason: str = "stop") -> None:
        self.tokenizer = tokenizer
        self.texts = texts
        self.finish_reason = finish_reason
        self.calls: list[tuple[list[int], SamplingParams]] = []
        self.fail_next = False
        self.delay_s = 0.0  # a slow engine

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerateOutput:
        self.calls.append((list(prompt_ids), params))
        await asyncio.sleep(self.delay_s)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("CUDA fell over")
        text = self.texts[(len(self.calls) - 1) % len(self.texts)]
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if self.finish_reason == "stop":
            ids.append(self.tokenizer.convert_tokens_to_ids("<|im_end|>"))
        return GenerateOutput(ids, [-0.01 * (i + 1) for i in range(len(ids))], self.finish_reason)

    async def score(self, prompt_ids, continuation_ids):
        raise NotImplementedError

    def load_weights(self, named_tensors):
        raise NotImplementedError


def make_app(tokenizer, engine, recorder=None, **kw):
    return create_app(engine, tokenizer, api_token=TOKEN, model_name=MODEL, sampling_defaults=DEFAULTS,
                      recorder=SessionRecorder() if recorder is None else recorder, **kw)


@asynccontextmanager
async def serving(app):
    """A ProxyServer in the *test's* running loop, plus an openai client and a raw httpx client."""
    async with ProxyServer(app) as server:
        client = openai.AsyncOpenAI(base_url=server.url, api_key=TOKEN, max_retries=0, timeout=30)
        async with httpx.AsyncClient(base_url=server.url.removesuffix("/v1"), timeout=30) as http:
            yield server, client, http
        await client.close()


def run(coro_fn: Callable[[], Any]) -> Any:
    return asyncio.run(coro_fn())


def auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def rlsys_ext(completion) -> dict:
    return completion.model_extra["rlsys"]


# ---- Lifecycle, models, auth --------------------------------------------------------------------


def test_server_binds_loopback_free_port_and_stops(tokenizer):
    async def scenario():
        server = ProxyServer(make_app(tokenizer, ScriptedEngine(tokenizer, ["hi"])))
        url = await server.start()
        assert url == server.url and url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        assert 0 < server.port < 65536
        with pytest.raises(RuntimeError, match="already started"):
            await server.start()
        async with httpx.AsyncClient() as http:
            assert (await http.get(url.removesuffix("/v1") + "/health", headers=auth())).json() == {"status": "ok"}
        await server.stop()
        await server.stop()  # idempotent
        async with httpx.AsyncClient() as http:
            with pytest.raises(httpx.ConnectError):
                await http.get(url + "/models", headers=auth())

    run(scenario)


def test_an_idle_keep_alive_connection_outlives_the_clients_expiry(tokenizer):
    """httpx drops an idle connection after 5 s; the server must not drop it first (uvicorn's default is 5 s too,
    and a request sent on a connection the server is closing fails with "Server disconnected")."""
    async def scenario():
        server = ProxyServer(make_app(tokenizer, ScriptedEngine(tokenizer, ["hi"])))
        url = await server.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        request = (f"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n").encode()
        answers = []
        for pause in (0.0, 6.0):  # one request, 6 s idle on the same connection, another
            await asyncio.sleep(pause)
            writer.write(request)
            await writer.drain()
            answers.append(await asyncio.wait_for(reader.read(4096), 10))
        writer.close()
        await server.stop()
        return answers

    first, second = run(scenario)
    assert first.startswith(b"HTTP/1.1 200") and second.startswith(b"HTTP/1.1 200"), second


def test_start_failure_raises_and_leaves_the_loop_running(tokenizer):
    async def scenario():
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            server = ProxyServer(make_app(tokenizer, ScriptedEngine(tokenizer, ["hi"])), port=taken.getsockname()[1])
            with pytest.raises(RuntimeError, match="stopped before listening"):
                await server.start()
        await asyncio.sleep(0)  # the loop is still alive
        return "alive"

    assert run(scenario) == "alive"


def test_models_lists_the_model_and_wrong_key_is_refused(tokenizer):
    async def scenario():
        async with serving(make_app(tokenizer, ScriptedEngine(tokenizer, ["hi"]))) as (server, client, _http):
            async with openai.AsyncOpenAI(base_url=server.url, api_key="nope", max_retries=0) as bad:
                with pytest.raises(openai.AuthenticationError):
                    await bad.models.list()
            page = await client.models.list()
            assert [m.id for m in page.data] == [MODEL]
            assert page.data[0].owned_by == "rlsys" and page.data[0].object == "model"
            assert (await client.models.retrieve(MODEL)).id == MODEL
            with pytest.raises(openai.NotFoundError):
                await client.models.retrieve("gpt-4o")

    run(scenario)


@pytest.mark.parametrize("method,path", [
    ("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/health"), ("GET", "/nope"),
    ("GET", "/docs"), ("GET", "/openapi.json"), ("GET", "/redoc"), ("POST", "/v1/completions"),
])
def test_every_route_needs_the_token(tokenizer, method, path):
    engine = ScriptedEngine(tokenizer, ["hi"])

    async def scenario():
        async with serving(make_app(tokenizer, engine)) as (_, _client, http):
            body = {"model": MODEL, "messages": BOARD}
            for headers in ({}, auth("wrong-token"), {"Authorization": TOKEN}, {"Authorization": f"Basic {TOKEN}"},
                            auth(TOKEN + "x"), {"Authorization": "Bearer"}):
                r = await http.request(method, path, headers=headers, json=body)
                assert r.status_code == 401, (headers, r.status_code, r.text)
                err = r.json()["error"]
                assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key"
            r = await http.request(method, path, headers=auth(), json=body)
            assert r.status_code != 401
            if path in ("/nope", "/docs", "/openapi.json", "/redoc", "/v1/completions"):
                assert r.status_code == 404 and "error" in r.json()
            assert engine.calls == [] or path == "/v1/chat/completions"

    run(scenario)


# ---- Completions: tool calls, sessions ----------------------------------------------------------


def test_tool_call_block_with_named_tool_choice(tokenizer):
    engine = ScriptedEngine(tokenizer, [CALL_BLOCK])

    async def scenario():
        async with serving(make_app(tokenizer, engine)) as (_, client, _h):
            resp = await client.chat.completions.create(
                model=MODEL, messages=BOARD, tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "choose_square"}})
            choice = resp.choices[0]
            assert choice.finish_reason == "tool_calls"
            assert choice.message.content is None
            (call,) = choice.message.tool_calls
            assert call.type == "function" and call.function.name == "choose_square"
            assert json.loads(call.function.arguments) == {"square": 5}
            assert call.id.startswith("call_")
            assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion" and resp.model == MODEL
            ext = rlsys_ext(resp)
            assert ext["tool_call_errors"] == [] and ext["session_id"] is None
            assert resp.usage.prompt_tokens == len(ext["prompt_ids"])
            assert resp.usage.completion_tokens == len(ext["completion_ids"])

    run(scenario)


def test_bare_json_call_and_content_around_it(tokenizer):
    text = 'I will take the centre.\n{"name": "choose_square", "arguments": {"square": 5}}'
    engine = ScriptedEngine(tokenizer, [text])

    async def scenario():
        async with serving(make_app(tokenizer, engine)) as (_, client, _h):
            resp = await client.chat.completions.create(model=MODEL, messages=BOARD, tools=TOOLS)
            msg = resp.choices[0].message
            assert resp.choices[0].finish_reason == "tool_calls"
            assert msg.content == "I will take the centre."
            assert [json.loads(c.function.arguments) for c in msg.tool_calls] == [{"square": 5}]

    run(scenario)


def test_no_tools_or_tool_choice_none_returns_text_unparsed(tokenizer):
    engine = ScriptedEngine(tokenizer, [CALL_BLOCK])

    async def scenario():
        async with serving(make_app(tokenizer, engine)) as (_, client, _h):
            for kwargs in ({}, {"tools": TOOLS, "tool_choice": "none"}):
                resp = await client.chat.completions.create(model=MODEL, messages=BOARD, **kwargs)
                assert resp.choices[0].finish_reason == "stop" and resp.choices[0].message.tool_calls is None
                assert resp.choices[0].message.content == CALL_BLOCK
            # tool_choice "none" renders the prompt without tools: same ids as no tools at all.
            assert engine.calls[0][0] == engine.calls[1][0]
            assert engine.calls[0][0] == tokenizer.apply_chat_template(
                BOARD, add_generation_prompt=True, tokenize=True, return_dict=False)

    run(scenario)


def test_malformed_call_is_reported_and_stays_content(tokenizer):
    text = '<tool_call>\n{"name": "choose_square", "arguments": {"square": 5</tool_call>'
    engine = ScriptedEngine(tokenizer, [text])

    async def scenario():
        async with serving(make_app(tokenizer, engine)) as (_, client, _h):
            resp = await client.chat.completions.create(model=MODEL, messages=BOARD, tools=TOOLS)
            assert resp.choices[0].finish_reason == "stop" and resp.choices[0].message.tool_calls is None
            assert resp.choices[0].message.content == text
            assert [e["kind"] for e in rlsys_ext(resp)["tool_call_errors"]] == ["invalid_json"]

    run(scenario)


def test_session_turn_has_exact_prompt_and_sampled_ids(tokenizer):
    engine = ScriptedEngine(tokenizer, [CALL_BLOCK])
    recorder = SessionRecorder()

    async def scenario():
        async with serving(make_app(tokenizer, engine, recorder)) as (_, client, _h):
            resp = await client.chat.completions.create(model=MODEL, messages=BOARD, tools=TOOLS,
                                                        extra_headers={"X-Rlsys-Session": "ep-1"})
            return rlsys_ext(resp)

    ext = run(scenario)
    expected_prompt = tokenizer.apply_chat_template(BOARD, tools=TOOLS, add_generation_prompt=True,
                                                    tokenize=True, return_dict=False)
    (engine_prompt, params), = engine.calls
    assert ext["session_id"] == "ep-1"
    assert ext["prompt_ids"] == engine_prompt == expected_prompt
    completion = tokenizer.encode(CALL_BLOCK, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert ext["completion_ids"] == completion
    assert ext["logprobs"] == pytest.approx([-0.01 * (i + 1) for i in range(len(completion))])
    record = recorder.pop("ep-1")
    assert record.num_turns == 1 and record.segment_breaks == 0 and record.truncated_turns == 0
    (seg,) = record.segments
    assert seg.input_ids == expected_prompt + completion
    assert seg.loss_mask == [0] * len(expected_prompt) + [1] * len(completion)
    assert seg.rollout_logprobs[len(expected_prompt):] == ext["logprobs"]
    # Defaults reach the engine; generation stops at the end-of-turn tokens.
    assert params.max_new_tokens == DEFAULTS.max_new_tokens and params.temperature == DEFAULTS.temperature
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in params.stop_token_ids


def test_two_turn_tool_conversation_extends_one_segment(tokenizer):
    engine = ScriptedEngine(tokenizer, [CALL_BLOCK, "I took square 5."])
    recorder = SessionRecorder()
    headers = {"X-Rlsys-Session": "ep-2"}

    async def scenario():
        async with serving(make_app(tokenizer, engine, recorder)) as (_, client, _h):
            messages = list(BOARD)
            first = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                                         extra_headers=headers)
            # What an agent does: append the assistant message as returned, then the tool's result.
            messages.append(first.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "tool", "tool_call_id": first.choices[0].message.tool_calls[0].id,
                             "content": '{"ok": true}'})
            second = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                                          extra_headers=headers)
            return rlsys_ext(first), rlsys_ext(second)

    first, second = run(scenario)
    record = recorder.pop("ep-2")
    assert record.num_turns == 2 and record.segment_breaks == 0, "re-rendered history must extend the prefix"
    (seg,) = record.segments
    assert second["prompt_ids"][: len(first["prompt_ids"]) + len(first["completion_ids"])] == (
        first["prompt_ids"] + first["completion_ids"])
    assert seg.input_ids == second["prompt_ids"] + second["completion_ids"]
    sampled = [t for t, m in zip(seg.input_ids, seg.loss_mask) if m]
    assert sampled == first["completion_ids"] + second["completion_ids"]
    assert [lp for lp, m in zip(seg.rollout_logprobs, seg.loss_mask) if m] == first["logprobs"] + second["logprobs"]
    suffix = tokenizer.decode(second["prompt_ids"][len(first["prompt_ids"]) + len(first["completion_ids"]):])
    assert "<tool_response>" in suffix and suffix.endswith("<|im_start|>assistant\n")


def test_attempt_header_starts_a_new_life_of_the_session_and_is_validated(tokenizer):
    """A retried episode (new `X-Rlsys-Attempt`, same session id) must not extend the dead run's segment."""
    engine = ScriptedEngine(tokenizer, [CALL_BLOCK, CALL_BLOCK])
    recorder = SessionRecorder()

    async def scenario():
        async with serving(make_app(tokenizer, engine, recorder)) as (_, client, http):
            for attempt in ("run-1", "run-2"):
                await client.chat.completions.create(model=MODEL, messages=BOARD, tools=TOOLS, extra_headers={
                    "X-Rlsys-Session": "ep", "X-Rlsys-Attempt": attempt})
            return await http.post("/v1/chat/completions", json={"model": MODEL, "messages": BOARD},
                                   headers={**auth(), "X-Rlsys-Session": "ep", "X-Rlsys-Attempt": "x" * 257})

    bad = run(scenario)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Rlsys-Attempt", bad.text
    assert recorder.stats["superseded_sessions"] == 1
    record = recorder.pop("ep", "run-2")
    assert record.num_turns == 1 and record.segment_breaks == 0


def test_a_cut_off_answer_whose_call_parses_is_recorded_as_truncated(tokenizer):
    """The reply says `tool_calls` (its opening parsed), the session record says the engine cut it at max_tokens:
    what `algo.mask_truncated` reads (the length collapse of docs/results.md grew from such answers)."""
    engine = ScriptedEngine(tokenizer, [CALL_BLOCK + " and then some more words"], finish_reason="length")
    recorder = SessionRecorder()

    async def scenario():
        async with serving(make_app(tokenizer, engine, recorder)) as (_, client, _h):
            return await client.chat.completions.create(model=MODEL, messages=BOARD, tools=TOOLS,
                                                        extra_headers={"X-Rlsys-Session": "cut"})

    resp = run(scenario)
    assert resp.choices[0].finish_reason == "tool_calls" and resp.choices[0].message.tool_calls
    record = recorder.pop("cut")
    assert record.num_turns == 1 and record.truncated_turns == 1


def test_sampling_parameters_and_caps(tokenizer):
    engine = ScriptedEngine(tokenizer, ["ok"], finish_reason="length")

    async def scenario():
        app = make_app(tokenizer, engine, max_tokens_cap=100)
        async with serving(app) as (_, client, _h):
            r1 = await client.chat.completions.create(model=MODEL, messages=BOARD, max_tokens=10**6,
                                                      temperature=0.0, top_p=0.5, seed=7)
            await client.chat.completions.create(model=MODEL, messages=BOARD, max_completion_tokens=3)
            return r1

    r1 = run(scenario)
    assert r1.choices[0].finish_reason == "length"
    (_, p1), (_, p2) = engine.calls
    assert (p1.max_new_tokens, p1.temperature, p1.top_p, p1.seed) == (100, 0.0, 0.5, 7)
    assert (p2.max_new_tokens, p2.temperature, p2.top_p, p2.seed) == (3, 1.0, 1.0, None)


def test_logprobs_true_gives_per_token_entries(tokenizer):
    engine = ScriptedEngine(tokenizer, ["Hello there"])

    async def scenario():
        async with serving(make_app(tokenizer, engine)) as (_, client, _h):
            return await client.chat.completions.create(model=MODEL, messages=BOARD, logprobs=True)

    resp = run(scenario)
    entries = resp.choices[0].logprobs.content
    assert "".join(e.token for e in entries) == "Hello there"
    assert [e.logprob for e in entries] == rlsys_ext(resp)["logprobs"][:-1]  # the <|im_end|> is not text


def test_prompt_longer_than_context_is_400_and_room_clips_max_tokens(tokenizer):
    engine = ScriptedEngine(tokenizer, ["ok"])
    n_prompt = len(tokenizer.apply_chat_template(BOARD, add_generation_prompt=True, tokenize=True, return_dict=False))

    async def scenario():
        async with serving(make_app(tokenizer, engine, max_model_len=n_prompt + 4)) as (_, client, http):
            await client.chat.completions.create(model=MODEL, messages=BOARD, max_tokens=20)
            long = BOARD + [{"role": "user", "content": "more words " * 10}]
            r = await http.post("/v1/chat/completions", headers=auth(), json={"model": MODEL, "messages": long})
            return r

    r = run(scenario)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "context" in r.json()["error"]["message"]
    assert engine.calls[0][1].max_new_tokens == 4 and len(engine.calls) == 1


# ---- Errors --------------------------------------------------------------------------------------

GOOD = {"model": MODEL, "messages": BOARD}
BAD_REQUESTS = [
    ({**GOOD, "stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream is true"),
    ({**GOOD, "n": 2}, "n", "n=1"),
    ({**GOOD, "messages": BOARD + [{"role": "robot", "content": "x"}]}, "messages[2].role", "'system'"),
    ({**GOOD, "messages": []}, "messages", "at least 1"),
    ({**GOOD, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content", "text"),
    ({**GOOD, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "required"),
    ({**GOOD, "tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name", "pattern"),
    ({**GOOD, "tools": [{"type": "function"}]}, "tools[0].function", "required"),
    ({**GOOD, "tools": {"choose_square": {}}}, "tools", "list"),
    ({**GOOD, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "resign"}}},
     "tool_choice", "'resign'"),
    ({**GOOD, "tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({**GOOD, "temperature": -1}, "temperature", "greater than or equal"),
    ({**GOOD, "max_tokens": 0}, "max_tokens", "greater than or equal"),
    ({**GOOD, "messages": BOARD + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "choose_square", "arguments": "{square: 5"}}]}]},
     "messages[2].tool_calls[0].function.arguments", "not valid JSON"),
    ({"messages": BOARD}, "model", "required"),
]


@pytest.mark.parametrize("body,param,phrase", BAD_REQUESTS, ids=[p for _, p, _ in BAD_REQUESTS])
def test_bad_requests_are_400_naming_the_field(tokenizer, body, param, phrase):
    engine = ScriptedEngine(tokenizer, ["hi"])

    async def scenario():
        async with serving(make_app(tokenizer, engine)) as (_, _c, http):
            return await http.post("/v1/chat/completions", headers=auth(), json=body)

    r = run(scenario)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert err["message"].startswith(param + ":") and phrase in err["message"], err["message"]
    assert engine.calls == []


def test_non_json_wrong_model_and_oversized_bodies(tokenizer):
    engine = ScriptedEngine(tokenizer, ["hi"])

    async def chunks():
        for _ in range(20):
            yield b"x" * 1000

    async def scenario():
        async with serving(make_app(tokenizer, engine, max_request_bytes=10_000)) as (_, client, http):
            url = "/v1/chat/completions"
            out = {
                "not_json": await http.post(url, headers=auth(), content=b"{not json"),
                "nan": await http.post(url, headers=auth(), content=b'{"model": "tiny", "temperature": NaN}'),
                "array": await http.post(url, headers=auth(), json=[GOOD]),
                "surrogate": await http.post(url, headers=auth(),
                                             content=b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}'),
                "model": await http.post(url, headers=auth(), json={**GOOD, "model": "gpt-4o"}),
                "big": await http.post(url, headers=auth(), json={**GOOD, "pad": "x" * 20_000}),
                "big_chunked": await http.post(url, headers=auth(), content=chunks()),  # no Content-Length
            }
            with pytest.raises(openai.BadRequestError, match="only allowed when stream is true"):
                await client.chat.completions.create(model=MODEL, messages=BOARD,
                                                     stream_options={"include_usage": True})
            out["after"] = await http.post(url, headers=auth(), json=GOOD)
            return out

    out = run(scenario)
    for key in ("not_json", "nan", "array", "surrogate"):
        assert out[key].status_code == 400 and out[key].json()["error"]["param"] == "body", (key, out[key].text)
    assert out["model"].status_code == 404 and out["model"].json()["error"]["code"] == "model_not_found"
    for key in ("big", "big_chunked"):
        assert out[key].status_code == 413 and "10000 bytes" in out[key].json()["error"]["message"]
    assert out["after"].status_code == 200
    assert len(engine.calls) == 1


def test_engine_exception_is_500_and_server_keeps_serving(tokenizer, caplog):
    engine = ScriptedEngine(tokenizer, ["fine"])

    async def scenario():
        async with serving(make_app(tokenizer, engine)) as (_, client, _h):
            engine.fail_next = True
            with pytest.raises(openai.InternalServerError, match="CUDA fell over") as info:
                await client.chat.completions.create(model=MODEL, messages=BOARD)
            assert info.value.status_code == 500
            resp = await client.chat.completions.create(model=MODEL, messages=BOARD)
            assert resp.choices[0].message.content == "fine"

    run(scenario)
    assert any("engine.generate failed" in r.message for r in caplog.records)


# ---- Fuzz ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzz_server(tokenizer):
    """The server on an event loop in a background thread (as in a Ray async actor), for hypothesis's sync calls."""
    engine = ScriptedEngine(tokenizer, [CALL_BLOCK, "plain text", '{"name": "x"}'])
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = ProxyServer(make_app(tokenizer, engine, max_request_bytes=50_000, max_tokens_cap=8))
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
    with httpx.Client(base_url=server.url.removesuffix("/v1"), headers=auth(), timeout=30) as http:
        yield http
    asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                      st.text(max_size=20), st.sampled_from(["user", "tool", "none", "required", MODEL, "text"]))
json_value = st.recursive(json_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)), max_leaves=20)
adversarial_text = st.one_of(st.text(max_size=40), st.sampled_from([
    "<|im_end|>", "<|im_start|>assistant\n", "<tool_call>", "</tool_call>", "<|endoftext|>", "{{ 1/0 }}",
    "{% raise_exception('x') %}", "\x00", "\U0001f642" * 3, '{"name": "choose_square", "arguments": {"square": 5}}']))


def requests(noisy: bool):
    """Request bodies: well-formed (noisy=False) or with any field sometimes replaced by any JSON value."""
    def v(plausible):  # usually plausible, so noisy requests still get past the first errors
        return st.integers(0, 9).flatmap(lambda i: plausible if i < 8 else json_value) if noisy else plausible

    def obj(required, optional=None):
        return st.fixed_dictionaries({k: v(x) for k, x in required.items()},
                                     optional={k: v(x) for k, x in (optional or {}).items()})

    parts = st.lists(obj({"type": st.sampled_from(["text", "image_url"] if noisy else ["text"]),
                          "text": adversarial_text}), min_size=1, max_size=3)
    call = obj({"id": st.text(max_size=8), "type": st.just("function"), "function": obj({
        "name": st.sampled_from(["choose_square", "other", ""]),
        "arguments": st.sampled_from(['{"square": 5}', "{}", '{"a": [1, {"b": null}]}'] + ["[1]", "{bad"] * noisy)})})
    message = st.one_of(
        obj({"role": st.sampled_from(["system", "developer", "user"]), "content": st.one_of(adversarial_text, parts)}),
        obj({"role": st.just("assistant"), "content": st.one_of(st.none(), adversarial_text)},
            {"tool_calls": st.lists(call, min_size=1, max_size=2)}),
        obj({"role": st.just("tool"), "tool_call_id": st.text(max_size=8), "content": adversarial_text}),
    )
    tool = obj({"type": st.just("function"), "function": obj({"name": st.sampled_from(["choose_square", "bad name"])},
                                                             {"parameters": json_value})})
    choices = ["none", "auto", {"type": "function", "function": {"name": "choose_square"}}]
    return obj({"model": st.just(MODEL), "messages": st.lists(message, min_size=1, max_size=5)}, {
        "tools": st.one_of(st.just(TOOLS), st.lists(tool, max_size=2)) if noisy else st.just(TOOLS),
        "tool_choice": st.sampled_from(choices + ["required", {"type": "function", "function": {"name": "x"}}] * noisy),
        "max_tokens": st.integers(1 - 3 * noisy, 10**30), "max_completion_tokens": st.integers(1 - 3 * noisy, 10**9),
        "temperature": st.floats(-noisy, 2 + noisy), "top_p": st.floats(0.01 - noisy, 1 + noisy),
        "seed": st.integers() if noisy else st.integers(-(2**63), 2**63 - 1), "logprobs": st.booleans(),
        "n": st.integers(0, 3) if noisy else st.just(1), "stream": st.booleans() if noisy else st.just(False),
        "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=4), max_size=5)) if noisy
        else st.sampled_from([None, "", [], "\n", ["END", "</tool_call>"]]),
        "top_logprobs": st.integers(-1, 25) if noisy else st.just(0),
        "frequency_penalty": st.floats(-2 - noisy, 2 + noisy), "presence_penalty": st.floats(-2 - noisy, 2 + noisy),
        "logit_bias": st.dictionaries(st.sampled_from(["5", "1023"] + ["1024", "x", "-1"] * noisy),
                                      st.floats(-100 - noisy, 100 + noisy), max_size=3),
        "user": st.text(max_size=8), "store": st.booleans(),
        "metadata": st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2),
        "response_format": st.sampled_from([{"type": "text"}] + [{"type": "json_object"}] * noisy),
        "parallel_tool_calls": st.booleans() if noisy else st.just(True),
    })


body = st.one_of(
    requests(noisy=False).map(lambda d: json.dumps(d).encode()),
    requests(noisy=True).map(lambda d: json.dumps(d).encode()),
    json_value.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=200),
    st.text(max_size=200).map(lambda s: s.encode("utf-8", "surrogatepass")),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
          derandomize=True)
@given(raw=body, path=st.sampled_from(["/v1/chat/completions"] * 5 + ["/v1/models", "/health", "/x"]))
def test_fuzzed_requests_never_500(fuzz_server, raw, path):
    r = fuzz_server.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code < 500, (raw, r.status_code, r.text)
    if r.status_code != 200:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"]


def test_server_still_answers_after_fuzz(fuzz_server):
    r = fuzz_server.post("/v1/chat/completions", json={**GOOD, "tools": TOOLS})
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "chat.completion"


# ---- The real tiny model and engine -------------------------------------------------------------


def greedy_real_engine_app(model_dir, tokenizer, recorder: SessionRecorder, max_new_tokens: int, **engine_kw):
    """The real tiny model in a ``TransformersEngine`` behind the proxy, greedy by default: (engine, app)."""
    from rlsys.engines.transformers_engine import TransformersEngine

    engine = TransformersEngine(str(model_dir), device="cpu", **engine_kw)
    return engine, create_app(engine, tokenizer, api_token=TOKEN, model_name=MODEL, recorder=recorder,
                              sampling_defaults=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0))


def test_real_tiny_model_through_transformers_engine(model_dir, tokenizer):
    recorder = SessionRecorder()
    engine, app = greedy_real_engine_app(model_dir, tokenizer, recorder, 12)

    async def scenario():
        try:
            async with serving(app) as (_, client, _h):
                resps = await asyncio.gather(*[
                    client.chat.completions.create(model=MODEL, messages=BOARD, tools=TOOLS,
                                                   extra_headers={"X-Rlsys-Session": f"real-{i}"}, seed=i)
                    for i in range(2)])
                # A second turn in session real-1, the reply sent back as returned: its prompt is built
                # from the sampled ids, so it extends the segment even when the random weights' text would
                # not re-tokenise to them.
                history = BOARD + [resps[1].choices[0].message.model_dump(exclude_none=True),
                                   {"role": "user", "content": "Again."}]
                second = await client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                                              extra_headers={"X-Rlsys-Session": "real-1"})
                return resps, second
        finally:
            await engine.shutdown()

    resps, second = run(scenario)
    expected_prompt = tokenizer.apply_chat_template(BOARD, tools=TOOLS, add_generation_prompt=True,
                                                    tokenize=True, return_dict=False)
    for resp in resps:
        ext = rlsys_ext(resp)
        assert ext["prompt_ids"] == expected_prompt
        assert 1 <= len(ext["completion_ids"]) <= 12 and len(ext["logprobs"]) == len(ext["completion_ids"])
        assert all(lp <= 0.0 for lp in ext["logprobs"])
        assert resp.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # Greedy: both concurrent (batched) requests sampled the same tokens.
    assert rlsys_ext(resps[0])["completion_ids"] == rlsys_ext(resps[1])["completion_ids"]

    first = rlsys_ext(resps[0])
    (seg,) = recorder.pop("real-0").segments
    assert seg.input_ids == expected_prompt + first["completion_ids"]
    assert seg.loss_mask == [0] * len(expected_prompt) + [1] * len(first["completion_ids"])
    assert seg.rollout_logprobs[len(expected_prompt):] == first["logprobs"]

    record = recorder.pop("real-1")
    assert record.num_turns == 2 and record.segment_breaks == 0 and record.prompt_from_ids == 1
    assert rlsys_ext(second)["prompt_source"] == "prompt_from_ids"
    sampled = [t for seg in record.segments for t, m in zip(seg.input_ids, seg.loss_mask) if m]
    assert sampled == rlsys_ext(resps[1])["completion_ids"] + rlsys_ext(second)["completion_ids"]
    assert record.segments[-1].input_ids == rlsys_ext(second)["prompt_ids"] + rlsys_ext(second)["completion_ids"]


def test_the_codec_renders_a_repeated_conversation_once_and_hands_out_copies(tokenizer):
    from rlsys.proxy.server import _ChatCodec

    calls = []
    real = tokenizer.apply_chat_template

    class Counting:  # the tokenizer, counting its template renders
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def apply_chat_template(self, *args, **kwargs):
            calls.append(args[0])
            return real(*args, **kwargs)

    codec = _ChatCodec(Counting(), cache_size=2)
    board = [{"role": "user", "content": "X|2|3\n4|5|6\n7|8|9"}]
    tools = [{"type": "function", "function": {"name": "choose_square", "parameters": {"type": "object"}}}]
    first = codec.render(board, tools)
    assert first == codec._render(board, tools) and len(calls) == 2  # (the second: the check's own render)
    first.append(-1)  # a caller's list is its own
    assert codec.render(board, tools)[-1] != -1 and codec.cache_hits == 1 and len(calls) == 2
    assert codec.render(board, None) != codec.render(board, tools)  # tools are part of the key
    other = [{"role": "user", "content": "X|O|3\n4|5|6\n7|8|9"}]
    codec.render(other, tools)  # a third conversation evicts the least recently used (board without tools)
    n = len(calls)
    codec.render(board, tools)
    codec.render(board, None)
    assert len(calls) == n + 1, "the evicted conversation is rendered again, the recent one is not"
