"""``stream=True`` over real HTTP with the official openai client (sync and async): the streamed answer assembles
to the non-streamed one, and the session records the same tokens, logprobs and masks (rlsys/proxy/streaming.py)."""
from __future__ import annotations

import asyncio
import json

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from rlsys.proxy.sessions import SessionRecorder
from tests.unit.test_proxy_server import (  # noqa: F401 (fixtures)
    BOARD,
    CALL_BLOCK,
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

SEED = 11


def assembled(chunks: list) -> dict:
    """What the openai client's own accumulator makes of the chunks: the message, finish reason and logprobs."""
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    # the snapshot, not get_final_completion(), which raises on finish_reason "length"
    return view(state.current_completion_snapshot.choices[0])


def returned(completion) -> dict:
    return view(completion.choices[0])


def view(choice) -> dict:
    return {
        "content": choice.message.content,
        "tool_calls": [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []],
        "finish_reason": choice.finish_reason,
        "logprobs": None if choice.logprobs is None else [e.model_dump() for e in choice.logprobs.content or []],
    }


def recorded(recorder: SessionRecorder, session_id: str) -> list[tuple[list[int], list[int], list[float]]]:
    return [(s.input_ids, s.loss_mask, s.rollout_logprobs) for s in recorder.pop(session_id).segments]


def check_same_as_non_streamed(plain, plain_record: list, chunks: list, streamed_record: list) -> None:
    assert assembled(chunks) == returned(plain), "the streamed message assembles to the non-streamed one"
    last = [c for c in chunks if c.choices][-1]
    for key in ("prompt_ids", "completion_ids", "logprobs", "tool_call_errors"):
        assert last.model_extra["rlsys"][key] == rlsys_ext(plain)[key], key
    assert streamed_record == plain_record, "the session recorded other tokens, masks or logprobs"
    n_sampled = sum(sum(mask) for _, mask, _ in plain_record)
    assert n_sampled == len(rlsys_ext(plain)["completion_ids"])


def request(session_id: str, **kw) -> dict:
    return dict(model=MODEL, messages=BOARD, tools=TOOLS, temperature=1.0, seed=SEED, logprobs=True,
                extra_headers={"X-Rlsys-Session": session_id}, **kw)


# ---- The real tiny model: same seed, same tokens ----------------------------------------------------


def test_real_engine_streamed_equals_non_streamed_async_and_sync(model_dir, tokenizer):
    recorder = SessionRecorder()
    engine, app = greedy_real_engine_app(model_dir, tokenizer, recorder, 24)

    async def scenario():
        try:
            async with serving(app) as (server, client, _h):
                plain = await client.chat.completions.create(**request("plain"))
                stream = await client.chat.completions.create(
                    **request("async"), stream=True, stream_options={"include_usage": True})
                async_chunks = [chunk async for chunk in stream]

                def sync_stream() -> list:
                    with openai.OpenAI(base_url=server.url, api_key=TOKEN, max_retries=0, timeout=30) as sync:
                        return list(sync.chat.completions.create(**request("sync"), stream=True))

                sync_chunks = await asyncio.to_thread(sync_stream)
                return plain, async_chunks, sync_chunks
        finally:
            await engine.shutdown()

    plain, async_chunks, sync_chunks = run(scenario)
    assert len(rlsys_ext(plain)["completion_ids"]) >= 2 and plain.choices[0].logprobs.content
    plain_record = recorded(recorder, "plain")
    check_same_as_non_streamed(plain, plain_record, async_chunks, recorded(recorder, "async"))
    check_same_as_non_streamed(plain, plain_record, sync_chunks, recorded(recorder, "sync"))
    assert async_chunks[-1].choices == [] and async_chunks[-1].usage == plain.usage, "asked: usage last"
    assert all(c.usage is None for c in async_chunks[:-1])
    assert all(c.usage is None and c.choices for c in sync_chunks), "no usage chunk when not asked"
    assert sync_chunks[0].choices[0].delta.role == "assistant"
    assert sum(bool(c.choices[0].delta.content) for c in sync_chunks) > 1, "the content is not sent in pieces"


# ---- Tool calls, usage, errors (scripted engine: a known answer) ------------------------------------------


TWO_CALLS = "I take the centre. " + CALL_BLOCK + "\n" + CALL_BLOCK.replace('"square": 5', '"square": 1')


@pytest.mark.parametrize("answer,squares", [(TWO_CALLS, [5, 1]), (CALL_BLOCK, [5])], ids=["content+2", "call-only"])
def test_tool_calls_stream_as_deltas_the_client_reassembles(tokenizer, answer, squares):
    recorder = SessionRecorder()
    engine = ScriptedEngine(tokenizer, [answer])

    async def scenario():
        async with serving(make_app(tokenizer, engine, recorder)) as (_, client, _h):
            plain = await client.chat.completions.create(**request("plain"))
            stream = await client.chat.completions.create(**request("streamed"), stream=True)
            return plain, [chunk async for chunk in stream]

    plain, chunks = run(scenario)
    assert [json.loads(c.function.arguments)["square"] for c in plain.choices[0].message.tool_calls] == squares
    assert (plain.choices[0].message.content is None) == (answer == CALL_BLOCK)
    check_same_as_non_streamed(plain, recorded(recorder, "plain"), chunks, recorded(recorder, "streamed"))
    calls = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    heads = [d for d in calls if d.id is not None]
    assert [(d.index, d.type, d.function.name, d.function.arguments) for d in heads] == [
        (i, "function", "choose_square", "") for i in range(len(squares))]
    assert all(d.function.name is None for d in calls if d.id is None)
    for i, square in enumerate(squares):
        assert "".join(d.function.arguments for d in calls if d.index == i) == json.dumps({"square": square})
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_sse_wire_format_usage_only_when_asked(tokenizer):
    engine = ScriptedEngine(tokenizer, ["Centre, then a corner: square 5."])
    body = {"model": MODEL, "messages": BOARD, "stream": True}

    async def scenario():
        async with serving(make_app(tokenizer, engine)) as (_, _c, http):
            plain = (await http.post("/v1/chat/completions", headers=auth(), json={**body, "stream": False})).json()
            without = await http.post("/v1/chat/completions", headers=auth(), json=body)
            with_usage = await http.post("/v1/chat/completions", headers=auth(),
                                         json={**body, "stream_options": {"include_usage": True}})
            return plain, without, with_usage

    plain, without, with_usage = run(scenario)
    for r in (without, with_usage):
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.text.endswith("data: [DONE]\n\n")
    events = [json.loads(e.removeprefix("data: ")) for e in with_usage.text.split("\n\n")[:-2]]
    assert {e["id"] for e in events} == {events[0]["id"]} and {e["object"] for e in events} == {"chat.completion.chunk"}
    assert events[-1]["choices"] == [] and events[-1]["usage"] == plain["usage"]
    assert all(e["usage"] is None for e in events[:-1])
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == plain["choices"][0][
        "message"]["content"]
    assert all("usage" not in json.loads(e.removeprefix("data: "))
               for e in without.text.split("\n\n")[:-2]), "usage sent without include_usage"


def test_errors_before_the_stream_are_json_and_an_engine_error_ends_it(tokenizer, caplog):
    recorder = SessionRecorder()
    engine = ScriptedEngine(tokenizer, ["fine"])

    async def scenario():
        async with serving(make_app(tokenizer, engine, recorder)) as (_, client, _h):
            with pytest.raises(openai.BadRequestError, match="n=1") as before:
                await client.chat.completions.create(model=MODEL, messages=BOARD, stream=True, n=2)
            engine.fail_next = True
            stream = await client.chat.completions.create(model=MODEL, messages=BOARD, stream=True,
                                                          extra_headers={"X-Rlsys-Session": "failed"})
            got = []
            with pytest.raises(openai.APIError, match="CUDA fell over"):
                async for chunk in stream:
                    got.append(chunk)
            after = await client.chat.completions.create(model=MODEL, messages=BOARD, stream=True)
            return before.value, got, [c async for c in after]

    before, got, after = run(scenario)
    assert before.status_code == 400 and before.body["param"] == "n"
    assert [c.choices[0].delta.role for c in got] == ["assistant"], "the role chunk, then the error event"
    assert assembled(after)["content"] == "fine", "the server keeps serving"
    assert recorder.num_turns("failed") == 0
    assert any("engine.generate failed" in r.message for r in caplog.records)


def test_a_client_that_leaves_mid_stream_still_has_its_turn_recorded(tokenizer):
    recorder = SessionRecorder()
    engine = ScriptedEngine(tokenizer, ["slow answer"])
    engine.delay_s = 0.5

    async def scenario():
        async with serving(make_app(tokenizer, engine, recorder)) as (_, _c, http):
            body = {"model": MODEL, "messages": BOARD, "stream": True}
            headers = {**auth(), "X-Rlsys-Session": "gone"}
            async with http.stream("POST", "/v1/chat/completions", headers=headers, json=body) as r:
                async for line in r.aiter_lines():
                    assert '"role": "assistant"' in line
                    break  # leave while the engine generates
            await asyncio.sleep(1.0)
            return recorder.num_turns("gone")

    assert run(scenario) == 1


def test_keep_alive_comments_while_the_engine_works_are_ignored_by_the_client(tokenizer, monkeypatch):
    monkeypatch.setattr("rlsys.proxy.streaming.KEEPALIVE_S", 0.05)
    engine = ScriptedEngine(tokenizer, ["patience"])
    engine.delay_s = 0.4

    async def scenario():
        async with serving(make_app(tokenizer, engine)) as (_, client, http):
            raw = await http.post("/v1/chat/completions", headers=auth(),
                                  json={"model": MODEL, "messages": BOARD, "stream": True})
            stream = await client.chat.completions.create(model=MODEL, messages=BOARD, stream=True)
            return raw.text, [c async for c in stream]

    text, chunks = run(scenario)
    assert ": keep-alive\n\n" in text
    assert assembled(chunks)["content"] == "patience"
