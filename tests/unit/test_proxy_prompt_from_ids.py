"""Multi-turn sessions through the proxy: prompts built from token ids, per-request seeds, late turns.

Real HTTP, the official openai client and the tiny model's tokenizer and Qwen2.5-style template. A
``ScriptedEngine`` answers fixed texts (Qwen 0.5B's habits: bare or fenced JSON calls, compact JSON, a
stop on <|endoftext|>, a cut by max_tokens), so the recorded ids can be checked token by token; the last
test runs the real tiny model through ``TransformersEngine``.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from rlsys.engines.base import Engine, SamplingParams
from rlsys.models.tiny import ensure_tiny_model
from rlsys.proxy.server import ProxyServer, create_app
from rlsys.proxy.sessions import SessionRecorder
from tests.scripted_engine import ScriptedEngine

TOKEN = "test-token-prompt-from-ids"
MODEL = "tiny"
SESSION = "X-Rlsys-Session"
IM_END, EOT = "<|im_end|>", "<|endoftext|>"
TOOLS = [{
    "type": "function",
    "function": {
        "name": "choose_square",
        "description": "Put an X on a square.",
        "parameters": {"type": "object", "properties": {"square": {"type": "integer"}}, "required": ["square"]},
    },
}]
BOARD = [{"role": "system", "content": "You play X."}, {"role": "user", "content": "Board: XO.X.O... Your move."}]


def call_block(square: int) -> str:
    return f'<tool_call>\n{{"name": "choose_square", "arguments": {{"square": {square}}}}}\n</tool_call>'


# (sampled text, end token or None for a cut by max_tokens): each parses as one choose_square call
REPLIES = {
    "canonical": (call_block(2), IM_END),
    "bare_json": ('{"name": "choose_square", "arguments": {"square": 2}}', IM_END),
    "fenced_json": ('```json\n{"name": "choose_square", "arguments": {"square": 2}}\n```', IM_END),
    "compact_json": ('<tool_call>\n{"name":"choose_square","arguments":{"square":2}}\n</tool_call>', IM_END),
    "key_order": ('<tool_call>\n{"arguments": {"square": 2}, "name": "choose_square"}\n</tool_call>', IM_END),
    "text_around_call": ("Corner. " + call_block(2) + "\nDone.", IM_END),
    "missing_end_tag": ('<tool_call>\n{"name": "choose_square", "arguments": {"square": 2}}', IM_END),
    "stopped_on_endoftext": (call_block(2), EOT),
    "cut_by_max_tokens": ('{"name": "choose_square", "arguments": {"square": 2}}', None),
}


@pytest.fixture(scope="module")
def model_dir():
    return ensure_tiny_model()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def serve(engine: Engine, tokenizer: Any, recorder: SessionRecorder, scenario, **kw) -> Any:
    """Run `scenario(client)` against the real proxy app served in this test's event loop."""
    app = create_app(engine, tokenizer, api_token=TOKEN, model_name=MODEL, recorder=recorder,
                     sampling_defaults=kw.pop("defaults", SamplingParams(max_new_tokens=64)), max_model_len=4096, **kw)

    async def main():
        async with ProxyServer(app) as server:
            client = openai.AsyncOpenAI(base_url=server.url, api_key=TOKEN, max_retries=0, timeout=60,
                                        default_headers={SESSION: "s"})
            try:
                return await scenario(client)
            finally:
                await client.close()

    return asyncio.run(main())


def ext(response) -> dict:
    return response.model_extra["rlsys"]


async def three_turns(client, edit=None) -> list[Any]:
    """An agent: each reply goes back as returned, then a tool result per call (or a user nudge);
    `edit(messages)` may rewrite the history before the last request."""
    messages, responses = list(BOARD), []
    for turn in range(3):
        if turn == 2 and edit is not None:
            edit(messages)
        response = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        responses.append(response)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "O played 5.\nYour move."})
        if not message.tool_calls:
            messages.append({"role": "user", "content": "Your move."})
    return responses


def sampled_tokens(record) -> list[int]:
    return [t for seg in record.segments for t, m in zip(seg.input_ids, seg.loss_mask) if m]


# ---- prompts from ids ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(REPLIES))
def test_three_turns_with_a_reply_the_template_would_rerender_differently_are_one_segment(tokenizer, case):
    text, end = REPLIES[case]
    recorder = SessionRecorder()
    engine = ScriptedEngine(tokenizer, [(text, end), (text, end), ("I am done.", IM_END)], repeat_last=True)
    responses = serve(engine, tokenizer, recorder, three_turns)
    turns = [ext(r) for r in responses]
    assert [r.choices[0].finish_reason for r in responses[:2]] == ["tool_calls"] * 2, case
    assert [t["prompt_source"] for t in turns] == ["first", "prompt_from_ids", "prompt_from_ids"]
    record = recorder.pop("s")
    assert (record.num_turns, record.segment_breaks, record.prompt_from_ids, record.re_rendered) == (3, 0, 2, 0), case
    (seg,) = record.segments
    assert seg.input_ids == turns[-1]["prompt_ids"] + turns[-1]["completion_ids"]
    assert [p for p, _ in engine.calls] == [t["prompt_ids"] for t in turns], "recorded prompt != engine prompt"
    # token-level: the loss mask sits exactly on the sampled ids, with the engine's logprobs
    assert sampled_tokens(record) == [tok for t in turns for tok in t["completion_ids"]]
    sampled_logprobs = [lp for lp, m in zip(seg.rollout_logprobs, seg.loss_mask) if m]
    assert sampled_logprobs == [lp for t in turns for lp in t["logprobs"]]
    for prev, cur in zip(turns, turns[1:]):
        cut = len(prev["prompt_ids"]) + len(prev["completion_ids"])
        assert cur["prompt_ids"][:cut] == prev["prompt_ids"] + prev["completion_ids"]
        follows = tokenizer.decode(cur["prompt_ids"][cut:])
        # a cut turn is closed by the template's end-of-turn token, in the prompt (masked out)
        assert follows.startswith(IM_END + "\n" if end is None else "\n"), follows
        assert "<tool_response>\nO played 5.\nYour move.\n</tool_response>" in follows
        assert follows.endswith("<|im_start|>assistant\n")
    assert recorder.stats["prompt_from_ids"] == 2 and recorder.stats["re_rendered"] == 0


def test_prompt_from_ids_equals_the_full_render_when_the_reply_rerenders_exactly(tokenizer):
    recorder = SessionRecorder()
    script = [REPLIES["canonical"], REPLIES["canonical"], ("I am done.", IM_END)]
    engine = ScriptedEngine(tokenizer, script, repeat_last=True)

    async def scenario(client):
        responses = await three_turns(client)
        history = list(BOARD)
        for r in responses[:2]:
            message = r.choices[0].message
            history += [message.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": message.tool_calls[0].id,
                         "content": "O played 5.\nYour move."}]
        return responses, history

    responses, history = serve(engine, tokenizer, recorder, scenario)
    full = tokenizer.apply_chat_template(history, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)
    assert ext(responses[-1])["prompt_source"] == "prompt_from_ids" and ext(responses[-1])["prompt_ids"] == full


def test_user_message_after_plain_text_reply_is_one_segment(tokenizer):
    recorder = SessionRecorder()
    # "\n\nSure" re-renders as one merged "\n\n" after the assistant header, not as the sampled ids
    script = [("\n\nSure, I think so", IM_END), ("Fine.", IM_END), ("Done.", IM_END)]
    engine = ScriptedEngine(tokenizer, script, repeat_last=True)
    responses = serve(engine, tokenizer, recorder, three_turns)
    record = recorder.pop("s")
    assert (record.segment_breaks, record.prompt_from_ids) == (0, 2)
    assert sampled_tokens(record) == [tok for r in responses for tok in ext(r)["completion_ids"]]


def edit_first_user_message(messages: list[dict]) -> None:
    messages[1] = {"role": "user", "content": "Board: XO.X.O... Your move, quickly."}


def rewrite_first_reply(messages: list[dict]) -> None:
    messages[2]["tool_calls"][0]["function"]["arguments"] = '{"square": 3}'


@pytest.mark.parametrize("edit, reason", [(edit_first_user_message, "history_changed"),
                                          (rewrite_first_reply, "history_changed"),
                                          (lambda m: m.__delitem__(slice(2, 4)), "history_changed"),
                                          (lambda m: m.pop(), "no_new_messages"),
                                          (lambda m: m[0].update(content="You play O."), "history_changed")])
def test_an_edited_history_is_rendered_in_full_and_the_break_is_counted(tokenizer, edit, reason):
    recorder = SessionRecorder()
    script = [REPLIES["bare_json"], REPLIES["bare_json"], ("Done.", IM_END)]
    engine = ScriptedEngine(tokenizer, script, repeat_last=True)
    responses = serve(engine, tokenizer, recorder, lambda client: three_turns(client, edit))
    assert [ext(r)["prompt_source"] for r in responses] == ["first", "prompt_from_ids", "re_rendered"]
    record = recorder.pop("s")
    assert (record.num_turns, record.segment_breaks, record.prompt_from_ids, record.re_rendered) == (3, 1, 1, 1)
    assert recorder.stats[f"re_rendered_{reason}"] == 1
    first, second = record.segments
    assert second.input_ids == ext(responses[-1])["prompt_ids"] + ext(responses[-1])["completion_ids"]
    assert sampled_tokens(record) == [tok for r in responses for tok in ext(r)["completion_ids"]]


@pytest.mark.parametrize("second_messages, reason", [
    (lambda reply: BOARD + [reply], "no_new_messages"),
    (lambda reply: BOARD + [{**reply, "content": "I pick 2."}, {"role": "user", "content": "ok"}], "reply_changed"),
])
def test_a_reply_sent_back_changed_or_without_new_messages_is_rendered_in_full(tokenizer, second_messages, reason):
    recorder = SessionRecorder()
    engine = ScriptedEngine(tokenizer, [REPLIES["canonical"]], repeat_last=True)

    async def scenario(client):
        first = await client.chat.completions.create(model=MODEL, messages=BOARD, tools=TOOLS)
        reply = first.choices[0].message.model_dump(exclude_none=True)
        return await client.chat.completions.create(model=MODEL, messages=second_messages(reply), tools=TOOLS)

    second = serve(engine, tokenizer, recorder, scenario)
    assert ext(second)["prompt_source"] == "re_rendered" and recorder.stats[f"re_rendered_{reason}"] == 1


def test_changed_tools_are_rendered_in_full(tokenizer):
    recorder = SessionRecorder()
    engine = ScriptedEngine(tokenizer, [("Hello.", IM_END)], repeat_last=True)

    async def scenario(client):
        first = await client.chat.completions.create(model=MODEL, messages=BOARD, tools=TOOLS)
        messages = BOARD + [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Go."}]
        return await client.chat.completions.create(model=MODEL, messages=messages)

    second = serve(engine, tokenizer, recorder, scenario)
    assert ext(second)["prompt_source"] == "re_rendered" and recorder.stats["re_rendered_tools_changed"] == 1
    assert recorder.pop("s").segment_breaks == 1  # the system prompt lost its tool list


# ---- seeds and late turns ---------------------------------------------------------------------------


def test_concurrent_requests_of_one_session_get_distinct_seeds_and_a_sequential_agent_the_usual_ones(tokenizer):
    recorder = SessionRecorder()
    engine = ScriptedEngine(tokenizer, [("Hi.", IM_END)], repeat_last=True)

    async def scenario(client):
        await asyncio.gather(*[client.chat.completions.create(model=MODEL, messages=BOARD) for _ in range(4)])
        for _ in range(3):
            await client.chat.completions.create(model=MODEL, messages=BOARD, extra_headers={SESSION: "seq"})

    serve(engine, tokenizer, recorder, scenario, seed_for_session=lambda sid, index: 1000 * len(sid) + index)
    seeds = [params.seed for _, params in engine.calls]
    assert sorted(seeds[:4]) == [1000, 1001, 1002, 1003], "concurrent requests of one session shared a seed"
    assert seeds[4:] == [3000, 3001, 3002], "a sequential agent's turn k is seeded with index k"


def test_turn_finishing_after_the_session_was_popped_is_dropped_and_counted(tokenizer):
    recorder = SessionRecorder()
    engine = ScriptedEngine(tokenizer, [("Hi.", IM_END)], repeat_last=True)

    async def scenario(client):
        engine.gate = asyncio.Event()
        in_flight = asyncio.create_task(client.chat.completions.create(model=MODEL, messages=BOARD))
        while not engine.calls:
            await asyncio.sleep(0.01)
        popped = recorder.pop("s")  # the env worker timed the agent out
        engine.gate.set()
        late = await in_flight
        after_pop = dict(recorder.stats)
        engine.gate = None
        again = await client.chat.completions.create(model=MODEL, messages=BOARD)  # a retry: a new life
        return popped, late, after_pop, again

    popped, late, after_pop, again = serve(engine, tokenizer, recorder, scenario)
    assert popped.num_turns == 0 and late.choices[0].message.content == "Hi."  # the agent still got its answer
    assert after_pop["late_turns"] == 1 and after_pop["live_sessions"] == 0, "the late turn made an orphan session"
    record = recorder.pop("s")
    assert record.num_turns == 1
    assert record.segments[0].input_ids == ext(again)["prompt_ids"] + ext(again)["completion_ids"]
    assert ext(again)["prompt_source"] == "first"


async def one_request_agent(item: dict, client: Any, model: str) -> dict:
    """Env-worker plug-in (loaded from this file): one request, answered after the agent's timeout."""
    await client.chat.completions.create(model=model, messages=BOARD)
    return {}


def zero_reward(record: dict) -> float:
    return 0.0


class _RemoteMethod:
    """`actor.method.remote(...)` awaited in process, as the env worker calls the rollout actor."""

    def __init__(self, fn) -> None:
        self.fn = fn

    async def remote(self, *args):
        return self.fn(*args)


def _hi_proxy_and_worker(tokenizer, agent: str, reward: str, **worker_kwargs):
    """A proxy app whose engine answers "Hi." to everything, its recorder and engine, and an env worker running
    this file's ``agent`` and ``reward``."""
    from actors.env_worker import EnvWorker

    recorder = SessionRecorder()
    engine = ScriptedEngine(tokenizer, [("Hi.", IM_END)], repeat_last=True)
    app = create_app(engine, tokenizer, api_token=TOKEN, model_name=MODEL, recorder=recorder,
                     sampling_defaults=SamplingParams(max_new_tokens=8))
    worker = EnvWorker(f"{__file__}:{agent}", f"{__file__}:{reward}", reward_timeout_s=5.0, **worker_kwargs)
    return app, recorder, engine, worker


def test_env_worker_timing_out_an_agent_with_a_request_in_flight_leaves_no_orphan_session(tokenizer):
    app, recorder, engine, worker = _hi_proxy_and_worker(tokenizer, "one_request_agent", "zero_reward",
                                                         agent_timeout_s=1.0)

    async def main():
        engine.gate = asyncio.Event()
        async with ProxyServer(app) as server:
            proxy = {"url": server.url, "token": TOKEN, "model": MODEL,
                     "actor": type("Actor", (), {"pop_sessions": _RemoteMethod(
                         lambda sessions: [recorder.pop(*session) for session in sessions])})()}
            traj, summary = await worker.run_episodes(proxy, [({"id": "i"}, 0, 0, "episode-0")])
            engine.gate.set()  # the engine finishes the abandoned request after the pop
            for _ in range(500):
                if recorder.stats["late_turns"]:
                    break
                await asyncio.sleep(0.01)
        await worker.close()
        return traj, summary

    traj, summary = asyncio.run(main())
    assert traj.failed and traj.fail_reason.startswith("agent_timeout") and traj.num_turns == 0
    assert (summary.prompt_from_ids, summary.re_rendered) == (0, 0)
    stats = recorder.stats
    assert stats["late_turns"] == 1 and stats["live_sessions"] == 0 and "episode-0" not in recorder


_RUNNING = {"now": 0, "most": 0}


async def counting_agent(item: dict, client: Any, model: str) -> dict:
    """Env-worker plug-in: one request; counts the agents of this process running at once."""
    _RUNNING["now"] += 1
    _RUNNING["most"] = max(_RUNNING["most"], _RUNNING["now"])
    try:
        await asyncio.sleep(0.02)  # every agent of the batch is started before any finishes
        response = await client.chat.completions.create(model=model, messages=BOARD)
        return {"content": response.choices[0].message.content, "item": item["id"]}
    finally:
        _RUNNING["now"] -= 1


def item_reward(record: dict) -> float:
    return float(record["item"]["id"].removeprefix("b"))


def test_env_worker_runs_a_batch_of_episodes_in_order_within_its_concurrency_and_pops_them_in_one_call(tokenizer):
    app, recorder, _, worker = _hi_proxy_and_worker(tokenizer, "counting_agent", "item_reward", agent_timeout_s=10.0,
                                                    max_concurrency=3)
    pops = []

    def pop_sessions(sessions):
        pops.append([sid for sid, _ in sessions])
        return [recorder.pop(*session) for session in sessions]

    episodes = [({"id": f"b{g}"}, g, s, f"episode-{g}-{s}") for g in range(4) for s in range(2)]

    async def main():
        async with ProxyServer(app) as server:
            proxy = {"url": server.url, "token": TOKEN, "model": MODEL,
                     "actor": type("Actor", (), {"pop_sessions": _RemoteMethod(pop_sessions)})()}
            try:
                return await worker.run_episodes(proxy, episodes)
            finally:
                await worker.close()

    out = asyncio.run(main())
    running = worker.agent.__globals__["_RUNNING"]  # the plug-in file is loaded as a module of its own
    trajs, summaries = out[0::2], out[1::2]
    assert [(t.group, t.sample) for t in trajs] == [(g, s) for _, g, s, _ in episodes]
    assert [(x.group, x.sample) for x in summaries] == [(g, s) for _, g, s, _ in episodes]
    assert [t.reward for t in trajs] == [float(g) for _, g, _, _ in episodes]  # each scored on its own item
    assert all(not t.failed and t.num_turns == 1 and t.info["output"]["content"] == "Hi." for t in trajs)
    assert pops == [[sid for *_, sid in episodes]], "the batch's sessions were not popped in one call"
    assert running["most"] == 3, f"max_concurrency=3, but {running['most']} agents ran at once"
    assert recorder.stats["live_sessions"] == 0


# ---- the real tiny model ----------------------------------------------------------------------------


def test_real_tiny_model_three_echoed_turns_are_one_segment_of_the_sampled_ids(model_dir, tokenizer):
    from rlsys.engines.transformers_engine import TransformersEngine

    engine = TransformersEngine(str(model_dir), device="cpu")
    recorder = SessionRecorder()

    async def scenario(client):
        try:
            return await three_turns(client)
        finally:
            await engine.shutdown()

    responses = serve(engine, tokenizer, recorder, scenario, seed_for_session=lambda sid, index: index,
                      defaults=SamplingParams(max_new_tokens=12, temperature=1.0))
    turns = [ext(r) for r in responses]
    record = recorder.pop("s")
    assert (record.num_turns, record.segment_breaks, record.prompt_from_ids) == (3, 0, 2), \
        [json.dumps(r.choices[0].message.content) for r in responses]
    (seg,) = record.segments
    assert seg.input_ids == turns[-1]["prompt_ids"] + turns[-1]["completion_ids"]
    assert sampled_tokens(record) == [tok for t in turns for tok in t["completion_ids"]]
    sampled_logprobs = [lp for lp, m in zip(seg.rollout_logprobs, seg.loss_mask) if m]
    assert sampled_logprobs == [lp for t in turns for lp in t["logprobs"]]


# ---- the delta's safety checks (pure, no server) -----------------------------------------------------


def continuation_case():
    """A previous exchange and a request that continues it (tool result after a bare JSON call)."""
    from rlsys.proxy.continuation import Exchange, message_keys, reply_key, tools_key

    reply = {"role": "assistant", "content": "",
             "tool_calls": [{"type": "function", "id": "c0",
                             "function": {"name": "choose_square", "arguments": {"square": 2}}}]}
    history = [dict(m) for m in BOARD]
    messages = history + [reply, {"role": "tool", "content": "ok", "tool_call_id": "c0"}]
    previous = Exchange(message_keys(history), tools_key(TOOLS), [1, 2, 3], [40, 41, 7],
                        reply_key(None, [("choose_square", {"square": 2})]))
    return previous, messages


def test_plan_falls_back_when_the_template_refuses_or_the_split_point_is_not_where_expected(tokenizer):
    from rlsys.proxy.continuation import PromptPlan, message_keys, plan_prompt
    from rlsys.proxy.schema import RequestError

    previous, messages = continuation_case()
    end_ids, decode = {7}, lambda ids: tokenizer.decode(ids)
    real_end = {tokenizer.convert_tokens_to_ids(IM_END)}

    def render(msgs):
        return tokenizer.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                             return_dict=False)

    def refuse(msgs):
        raise RequestError("messages", "no")

    plan = plan_prompt(previous, messages, message_keys(messages), TOOLS, render, real_end, decode)
    assert isinstance(plan, PromptPlan) and plan.prompt_ids[:6] == [1, 2, 3, 40, 41, 7]  # 7 closes the sampled turn
    assert plan_prompt(previous, messages, message_keys(messages), TOOLS, refuse, real_end, decode) == "template_error"
    # an end-of-turn id the template never emits: no split point
    assert plan_prompt(previous, messages, message_keys(messages), TOOLS, render, end_ids, decode) == "no_split_point"
    # the template renders something after the canonical reply, before its end-of-turn token
    suffixed = lambda msgs: render([{**m, "content": m["content"] + "!"} if m["role"] == "assistant" else m
                                    for m in msgs])
    plan = plan_prompt(previous, messages, message_keys(messages), TOOLS, suffixed, real_end, decode)
    assert plan == "no_split_point"
    # the previous turn was cut by max_tokens: the template's end-of-turn id is appended after the sampled ids
    cut = type(previous)(**{**previous.__dict__, "completion_ids": [40, 41]})
    plan = plan_prompt(cut, messages, message_keys(messages), TOOLS, render, real_end, decode)
    assert plan.prompt_ids[:6] == [1, 2, 3, 40, 41, *real_end]
