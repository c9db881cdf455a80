"""An environment whose tools live in an MCP server (rlsys/agents/mcp.py, the calculator of
rlsys/envs/mcp_calculator): the server starts per episode over stdio, its tools become the chat's `tools`, and
the model's calls run through the MCP session.

- Scripted engine, real proxy, real MCP server (no Ray): a solved question (two tool calls, then the answer), a
  call the server rejects, and the turn cap. The tool results come back as tool messages, masked out of the
  loss; the session stays one segment whose sampled tokens are exactly the loss mask.
- Real Ray job with the real tiny model: episodes run through the MCP agent, trajectories hold the sampled
  tokens, the learner trains.
"""
from __future__ import annotations

import json

import pytest

from tests.loop.conftest import REPO, job_config
from tests.loop.test_agent_frameworks import train_steps
from tests.loop.test_multiturn import IM_END, run_session

pytestmark = pytest.mark.timeout(300)

ITEM = {"id": "q", "question": "What is (2 + 3) * 4?", "answer": 20}


def call(name: str, **args) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def test_openai_tools_from_the_mcp_server_schema():
    import asyncio

    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    from rlsys.agents.mcp import openai_tools
    from rlsys.envs.mcp_calculator.agent import SERVER

    async def listed():
        params = StdioServerParameters(command=SERVER.command, args=SERVER.args, cwd=SERVER.cwd)
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            return openai_tools((await session.list_tools()).tools)

    tools = {t["function"]["name"]: t for t in asyncio.run(listed())}
    assert set(tools) == {"add", "multiply"}
    add = tools["add"]
    assert add["type"] == "function" and add["function"]["description"] == "Return a + b."
    assert add["function"]["parameters"]["required"] == ["a", "b"]


def test_solved_question_runs_the_tools_through_mcp_and_masks_their_results(tokenizer):
    from rlsys.envs.mcp_calculator.agent import agent
    from rlsys.envs.mcp_calculator.reward import outcome, reward

    script = [(call("add", a=2, b=3), IM_END), (call("multiply", a=5, b=4), IM_END), ("20", IM_END)]
    output, rec = run_session(tokenizer, script, agent, ITEM)
    assert output["end"] == "answer" and output["answer"] == "20"
    assert [(r["name"], r["text"], r["is_error"]) for r in output["tool_results"]] == [
        ("add", "5.0", False), ("multiply", "20.0", False)]
    assert reward({"item": ITEM, "output": output}) == 1.0 and outcome({"item": ITEM, "output": output}) == "correct"
    assert rec.num_turns == 3 and rec.segment_breaks == 0
    (seg,) = rec.segments
    masked_in = tokenizer.decode([t for t, m in zip(seg.input_ids, seg.loss_mask) if m])
    assert masked_in == "".join(text + end for text, end in script), "the loss mask is not on the sampled tokens"
    masked_out = tokenizer.decode([t for t, m in zip(seg.input_ids, seg.loss_mask) if not m])
    assert masked_out.count("<tool_response>") == 2 and "5.0" in masked_out and "20.0" in masked_out
    assert '"name": "multiply"' in masked_out, "the MCP tool list did not reach the prompt"


def test_a_rejected_call_comes_back_as_a_tool_message_and_the_turn_cap_ends_the_episode(tokenizer):
    from rlsys.envs.mcp_calculator.agent import MAX_TURNS, agent
    from rlsys.envs.mcp_calculator.reward import outcome

    # (a call naming no offered tool never reaches the agent: the proxy's parser reports it and returns text)
    script = [(call("add", a="x"), IM_END)]
    script += [(call("add", a=1, b=1), IM_END)] * (MAX_TURNS - len(script))
    output, rec = run_session(tokenizer, script, agent, ITEM)
    results = output["tool_results"]
    assert output["end"] == "max_turns" and output["answer"] is None and len(results) == MAX_TURNS
    assert results[0]["is_error"] and "validation error" in results[0]["text"]
    assert [(r["is_error"], r["text"]) for r in results[1:]] == [(False, "2.0")] * (MAX_TURNS - 1)
    assert outcome({"item": ITEM, "output": output}) == "no_answer"
    assert rec.num_turns == MAX_TURNS and rec.segment_breaks == 0


def test_mcp_environment_runs_two_training_steps_on_the_tiny_model(ray_local, tmp_path):
    data = REPO / "rlsys/envs/mcp_calculator/data/train.jsonl"
    cfg = job_config(tmp_path, "env.num_workers=1", batch_size="2", n_samples="2", max_new_tokens="16",
                     agent_fn="rlsys.envs.mcp_calculator.agent:agent",
                     reward_fn_path=str(REPO / "tests/loop/plugins/spread_mcp_reward.py"), dataset_path=str(data))

    def check(trajs):
        assert not any(t.failed for t in trajs), [t.fail_reason for t in trajs]
        for t in trajs:
            out = t.info["output"]
            assert t.num_turns == len(out["turns"]) >= 1 and len(out["tool_results"]) <= 4 * t.num_turns
            sampled = [tok for s in t.segments for tok, m in zip(s.input_ids, s.loss_mask) if m]
            assert sampled == [tok for turn in out["turns"] for tok in turn["completion_ids"]]

    train_steps(cfg, check)
