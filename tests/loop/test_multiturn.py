"""Multi-turn sessions at the token level: what the proxy records is what the engine sampled, across turns.

Two halves, because a random tiny model almost never writes a valid tool call:
- Scripted engine, real proxy over real HTTP, the tiny model's tokenizer and chat template (no Ray):
  whole games and ledger episodes with well-formed calls. These pin down prefix extension with tool
  calls and tool results (one segment, no break), the loss mask, every known way a re-render differs
  from the sample (the proxy builds the next prompt from ids: still one segment), and reward hacks
  through the real agents.
- Real Ray job with the real tiny model (transformers engine): a scripted 3-turn agent (module-level
  `echo_agent`, loaded by the env workers from this file) that echoes whatever the model said. Checked
  whatever the model produced: the recorded segments equal the ones the per-turn ids the proxy returned
  imply, the loss mask sits exactly on sampled ids, every echoed turn extends one segment (even where
  re-tokenising the sampled text would not reproduce it), the counts reach the trajectories and the step
  metrics, and the learner trains on the recorded segments.
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from rlsys.engines.base import SamplingParams
from rlsys.envs.tictactoe_game.turns import assistant_echo, tool_message, turn_record
from tests.scripted_engine import ScriptedEngine

pytestmark = pytest.mark.timeout(240)

THIS = Path(__file__).resolve()
SESSION = "X-Rlsys-Session"
TOKEN = "multiturn-test-token"
IM_END, EOT = "<|im_end|>", "<|endoftext|>"


# ---- plug-ins for the Ray half (the env workers import this file) -------------------------------


async def echo_agent(item: dict, client: Any, model: str) -> dict:
    """Three turns whatever the model says: echo its reply as returned, then a tool result per call,
    or a user nudge when it made none."""
    from rlsys.envs.tictactoe_game.prompt import CHOOSE_SQUARE_TOOL, first_messages

    messages = first_messages(item["start"])
    turns = []
    for _ in range(3):
        response = await client.chat.completions.create(model=model, messages=messages, tools=[CHOOSE_SQUARE_TOOL],
                                                        max_tokens=12)
        turn = turn_record(response, keep_prompt_ids=True)
        turn["logprobs"] = response.model_extra["rlsys"]["logprobs"]
        turns.append(turn)
        messages.append(assistant_echo(turn))
        if turn["tool_calls"]:
            messages += [tool_message(c["id"], "You played it.\nYour move.") for c in turn["tool_calls"]]
        else:
            messages.append({"role": "user", "content": "Your move."})
    return {"turns": turns}


def spread_reward(record: dict) -> float:
    """Varies within every group, so GSPO has a signal to train on."""
    return (sum(sum(t["completion_ids"]) for t in record["output"]["turns"]) % 7) / 6.0


# ---- shared checks ------------------------------------------------------------------------------


def expected_segments(turns: list[dict]) -> tuple[list[dict], int]:
    """The segments the per-turn (prompt_ids, completion_ids) the agent saw imply, and the breaks."""
    segments: list[dict] = []
    breaks = 0
    for t in turns:
        p, c, lp = t["prompt_ids"], t["completion_ids"], t["logprobs"]
        if segments and p[: len(segments[-1]["ids"])] == segments[-1]["ids"]:
            seg = segments[-1]
            suffix = p[len(seg["ids"]):]
            seg["ids"] += suffix + c
            seg["mask"] += [0] * len(suffix) + [1] * len(c)
            seg["lp"] += [0.0] * len(suffix) + list(lp)
        else:
            breaks += bool(segments)
            segments.append({"ids": p + c, "mask": [0] * len(p) + [1] * len(c), "lp": [0.0] * len(p) + list(lp)})
    return segments, breaks


def check_recorded(record_segments: list, breaks: int, turns: list[dict]) -> None:
    expected, expected_breaks = expected_segments(turns)
    assert breaks == expected_breaks
    assert [s.input_ids for s in record_segments] == [e["ids"] for e in expected], "recorded ids differ"
    assert [s.loss_mask for s in record_segments] == [e["mask"] for e in expected], "loss mask not on sampled ids"
    for s, e in zip(record_segments, expected):
        assert s.rollout_logprobs == pytest.approx(e["lp"], abs=1e-6)
    sampled = [tok for s in record_segments for tok, m in zip(s.input_ids, s.loss_mask) if m]
    assert sampled == [tok for t in turns for tok in t["completion_ids"]], "trained tokens != sampled tokens"


# ---- scripted engine, real proxy ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def run_session(tokenizer, script, agent_fn, item):
    """Serve the real proxy app in this loop, run `agent_fn(item, client, model)`; (output, SessionRecord)."""
    import openai

    from rlsys.proxy.server import ProxyServer, create_app
    from rlsys.proxy.sessions import SessionRecorder

    async def scenario():
        recorder = SessionRecorder()
        app = create_app(ScriptedEngine(tokenizer, script), tokenizer, api_token=TOKEN, model_name="m",
                         sampling_defaults=SamplingParams(max_new_tokens=64), recorder=recorder, max_model_len=4096)
        async with ProxyServer(app) as server:
            client = openai.AsyncOpenAI(base_url=server.url, api_key=TOKEN, max_retries=0, timeout=30,
                                        default_headers={SESSION: "s"})
            output = await agent_fn(item, client, "m")
            await client.close()
        return output, recorder.pop("s")

    output, rec = asyncio.run(scenario())
    for turn in output["turns"]:  # the scripted engine's logprobs, for check_recorded
        turn["logprobs"] = [-0.01 * (i + 1) for i in range(len(turn["completion_ids"]))]
    return output, rec


def call_text(square: int) -> str:
    return f'<tool_call>\n{{"name": "choose_square", "arguments": {{"square": {square}}}}}\n</tool_call>'


GAME = {"id": "g", "seed": 11, "start": ".........", "opponent": "minimax", "blunder": 0.0, "prompt_variant": "default"}


def test_whole_game_through_the_proxy_is_one_segment_with_only_sampled_tokens_in_the_loss(tokenizer):
    from rlsys.envs.tictactoe_game.agent import agent_with_prompt_ids
    from rlsys.envs.tictactoe_game.prompt import GAME_SENTENCE
    from rlsys.envs.tictactoe_game.reward import reward

    squares = best_after(GAME, [])
    output, rec = run_session(tokenizer, [(call_text(s), IM_END) for s in squares], agent_with_prompt_ids, GAME)
    assert output["outcome"] == "draw" and reward({"item": GAME, "output": output}) == 0.5
    assert rec.num_turns == len(squares) == 5 and rec.segment_breaks == 0
    check_recorded(rec.segments, rec.segment_breaks, output["turns"])
    (seg,) = rec.segments
    assert seg.input_ids == output["turns"][-1]["prompt_ids"] + output["turns"][-1]["completion_ids"]
    masked_in = tokenizer.decode([t for t, m in zip(seg.input_ids, seg.loss_mask) if m])
    assert masked_in == "".join(call_text(s) + IM_END for s in squares)
    # everything else (system prompt with the tools, the board, O's replies as tool results) is masked
    masked_out = tokenizer.decode([t for t, m in zip(seg.input_ids, seg.loss_mask) if not m])
    assert GAME_SENTENCE in masked_out and "1|2|3\n4|5|6\n7|8|9\nYour move." in masked_out
    assert masked_out.count("<tool_response>") == 4 and masked_out.count("O played") == 4


# (first sampled text, end token): each parses as a call on square 9 but re-renders differently; the
# proxy builds the next prompt from the sampled ids, so there is no break
RERENDER_BREAKS = {
    "compact_json": ('<tool_call>\n{"name":"choose_square","arguments":{"square":9}}\n</tool_call>', IM_END),
    "key_order": ('<tool_call>\n{"arguments": {"square": 9}, "name": "choose_square"}\n</tool_call>', IM_END),
    "no_newlines_in_block": ('<tool_call>{"name": "choose_square", "arguments": {"square": 9}}</tool_call>', IM_END),
    "text_before_call": ("Corner. " + call_text(9), IM_END),
    "text_after_call": (call_text(9) + "\nDone.", IM_END),
    "bare_json_call": ('{"name": "choose_square", "arguments": {"square": 9}}', IM_END),
    "parameters_key": ('<tool_call>\n{"name": "choose_square", "parameters": {"square": 9}}\n</tool_call>', IM_END),
    "stopped_on_endoftext": (call_text(9), EOT),
    "fenced_json_call": ('```json\n{"name": "choose_square", "arguments": {"square": 9}}\n```', IM_END),
    "cut_by_max_tokens": ('{"name": "choose_square", "arguments": {"square": 9}}', None),
}
# ... and these re-render exactly (the prompt from ids equals the full render)
RERENDER_EXACT = {
    "canonical": (call_text(9), IM_END),
    "text_then_newline_before_call": ("Corner.\n" + call_text(9), IM_END),  # the template's own separator
}


def best_after(item, opening):
    """X's minimax squares after X opened with `opening` (so a scripted game runs to its end)."""
    from rlsys.envs.tictactoe import game
    from rlsys.envs.tictactoe_game.episode import Game

    g, out = Game.start(item), []
    for square in opening:
        g.play_turn({"content": None, "tool_calls": [{"id": "c", "name": "choose_square",
                                                      "arguments": json.dumps({"square": square})}]})
    while not g.over:
        out.append(game.best_moves(g.board)[0])
        g.play_turn({"content": None, "tool_calls": [{"id": "c", "name": "choose_square",
                                                      "arguments": json.dumps({"square": out[-1]})}]})
    return out


@pytest.mark.parametrize("case", [*RERENDER_EXACT, *RERENDER_BREAKS])
def test_each_known_rerender_mismatch_stays_one_segment_built_from_ids(tokenizer, case):
    from rlsys.envs.tictactoe_game.agent import agent_with_prompt_ids

    first = {**RERENDER_EXACT, **RERENDER_BREAKS}[case]
    rest = best_after(GAME, [9])
    output, rec = run_session(tokenizer, [first] + [(call_text(s), IM_END) for s in rest], agent_with_prompt_ids, GAME)
    assert output["outcome"] in ("win", "draw", "loss") and rec.num_turns == 1 + len(rest) >= 2, output["outcome"]
    check_recorded(rec.segments, rec.segment_breaks, output["turns"])
    assert (rec.segment_breaks, rec.prompt_from_ids, rec.re_rendered) == (0, rec.num_turns - 1, 0), case
    assert len(rec.segments) == 1


def reformatted_arguments(message: dict) -> dict:
    for call in message.get("tool_calls", []):
        call["function"]["arguments"] = json.dumps(json.loads(call["function"]["arguments"]), indent=1)
    return message


def added_content(message: dict) -> dict:
    return {**message, "content": "My move."}


@pytest.mark.parametrize("rewrite, from_ids", [(reformatted_arguments, True), (added_content, False)])
def test_a_reply_sent_back_rewritten_is_rendered_in_full_and_breaks(tokenizer, monkeypatch, rewrite, from_ids):
    """An agent that sends back a rewritten reply gets today's full render, and a new segment, counted;
    the same arguments in other JSON spacing still count as the reply as returned."""
    from rlsys.envs.tictactoe_game import agent as game_agent

    monkeypatch.setattr(game_agent, "assistant_echo", lambda turn: rewrite(assistant_echo(turn)))
    rest = best_after(GAME, [9])
    script = [RERENDER_BREAKS["compact_json"]] + [(call_text(s), IM_END) for s in rest]
    output, rec = run_session(tokenizer, script, game_agent.agent_with_prompt_ids, GAME)
    check_recorded(rec.segments, rec.segment_breaks, output["turns"])
    later = rec.num_turns - 1
    assert later >= 2 and (rec.prompt_from_ids, rec.re_rendered) == ((later, 0) if from_ids else (0, later))
    assert rec.segment_breaks == (0 if from_ids else later)


def ledger_call(name: str, **args) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


LEDGER = json.loads((THIS.parents[2] / "rlsys/envs/ledger/data/train.jsonl").read_text().splitlines()[0])


def ledger_script(kind: str) -> list[tuple[str, str]]:
    from rlsys.envs.ledger.episode import targets
    from rlsys.envs.ledger.ledger import RANK, TRANSITIONS

    goal = targets(LEDGER)
    cur = {t["id"]: t["status"] for t in LEDGER["tickets"]}
    if kind == "claim":
        return [("All tickets are updated as requested.", IM_END)]
    if kind == "unknown_tool":
        return [(ledger_call("set_status", id=next(iter(goal)), status="closed"), IM_END)]
    script = [(ledger_call("list_tickets"), IM_END)]
    while any(cur[t] != s for t, s in goal.items()):
        tid = next(t for t, s in goal.items() if cur[t] != s)
        cur[tid] = next(n for n in TRANSITIONS[cur[tid]] if RANK[n] > RANK[cur[tid]])
        script.append((ledger_call("update_ticket", id=tid, status=cur[tid]), IM_END))
    if kind == "collateral":
        other = next(t for t in LEDGER["tickets"] if t["id"] not in goal and TRANSITIONS[t["status"]])
        script.append((ledger_call("update_ticket", id=other["id"], status=TRANSITIONS[other["status"]][0]), IM_END))
    return script + [("Done.", IM_END)]


@pytest.mark.parametrize("kind, expected", [("solve", "solved"), ("collateral", "collateral"),
                                            ("claim", "no_tool_call"), ("unknown_tool", "broken_call")])
def test_ledger_episodes_through_the_proxy_are_recorded_exactly_and_hacks_are_scored(tokenizer, kind, expected):
    from rlsys.envs.ledger.agent import agent_with_prompt_ids
    from rlsys.envs.ledger.reward import judge

    script = ledger_script(kind)
    output, rec = run_session(tokenizer, script, agent_with_prompt_ids, LEDGER)
    verdict = judge({"item": LEDGER, "output": output})
    assert verdict.outcome == expected, verdict
    assert verdict.reward == (1.0 if expected == "solved" else -1.0)
    assert rec.num_turns == len(script) and rec.segment_breaks == 0
    check_recorded(rec.segments, rec.segment_breaks, output["turns"])
    if kind == "solve":
        (seg,) = rec.segments
        masked_out = tokenizer.decode([t for t, m in zip(seg.input_ids, seg.loss_mask) if not m])
        assert masked_out.count("<tool_response>") == len(script) - 1 and '"changed": true' in masked_out


# ---- real Ray job, real tiny model --------------------------------------------------------------


def rerenders_exactly(tokenizer, completion_ids: list[int]) -> bool:
    """Would re-rendering this content-only assistant turn reproduce the sampled ids? Independent of
    the recorder: the template renders '<|im_start|>assistant\\n' + text + '<|im_end|>', tokenised as
    one chunk (so BPE may merge across the generation prompt and re-split a non-canonical sample)."""
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    end_ids = {im_end, tokenizer.convert_tokens_to_ids(EOT)}
    body = completion_ids[:-1] if completion_ids and completion_ids[-1] in end_ids else completion_ids
    head = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    text = tokenizer.decode(body, skip_special_tokens=False)
    rendered = tokenizer.encode("<|im_start|>assistant\n" + text + IM_END, add_special_tokens=False)
    sampled = head + completion_ids
    return rendered[: len(sampled)] == sampled


def test_real_model_sessions_match_the_engine_tokens_and_breaks_reach_the_metrics(ray_local, tmp_path, tokenizer):
    import ray

    from jobs.job import Job
    from rlsys.metrics import rollout_metrics
    from tests.loop.conftest import job_config

    data = THIS.parents[2] / "rlsys/envs/tictactoe_game/data/train.jsonl"
    cfg = job_config(tmp_path, "env.num_workers=1", "data.shuffle=false", batch_size="2", n_samples="2",
                     max_new_tokens="12", agent_fn=f"{THIS}:echo_agent", reward_fn_path=f"{THIS}:spread_reward",
                     dataset_path=str(data))
    job = Job.start(cfg)
    try:
        traj_refs, summaries = job.rollout(job.data.next_batch(cfg.rollout.batch_size), step=0)
        trajs = ray.get(traj_refs)
        assert [t.failed for t in trajs] == [False] * 4, [t.fail_reason for t in trajs]
        would_break = checked = 0
        for t, summary in zip(trajs, summaries):
            turns = t.info["output"]["turns"]
            assert t.num_turns == len(turns) == 3
            check_recorded(t.segments, t.segment_breaks, turns)
            assert (t.segment_breaks, t.prompt_from_ids, t.re_rendered) == (0, 2, 0), "an echoed turn broke"
            assert (summary.prompt_from_ids, summary.re_rendered) == (2, 0)
            for prev, cur in zip(turns, turns[1:]):
                assert cur["prompt_ids"][: len(prev["prompt_ids"]) + len(prev["completion_ids"])] == \
                    prev["prompt_ids"] + prev["completion_ids"]
                if not prev["tool_calls"]:  # what a full re-render would have done to this turn
                    would_break += not rerenders_exactly(tokenizer, prev["completion_ids"])
                    checked += 1
        print(f"real tiny model: {checked} content-only turns, {would_break} would have broken if re-rendered")
        metrics = rollout_metrics(summaries)
        assert metrics["rollout/num_turns_mean"] == 3.0
        assert metrics["rollout/segment_breaks"] == 0
        assert (metrics["rollout/prompt_from_ids"], metrics["rollout/re_rendered"]) == (2.0 * len(trajs), 0.0)
        job.engines.sleep(level=2)
        stats = job.train(traj_refs, summaries)
        assert stats["train/skipped_steps"] == 0 and stats["train/num_sequences"] == sum(len(t.segments) for t in trajs)
        recorded = {tuple(s.input_ids): s.loss_mask for t in trajs for s in t.segments}
        trained = ray.get(job.learner.last_trained.remote())
        assert trained and all(recorded[tuple(s.input_ids)] == s.loss_mask for s in trained)
    finally:
        job.shutdown()
