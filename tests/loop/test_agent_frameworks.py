"""Agents written with the OpenAI Agents SDK and with LangGraph run unchanged as rlsys agents (docs/agents.md).

Two halves, as in test_multiturn.py:
- Scripted engine, real proxy over real HTTP (no Ray): a well-formed move, a text answer and a call with bad
  arguments each reach the tic-tac-toe reward as the model wrote them, in one recorded session whose loss mask
  covers exactly the sampled tokens.
- Real Ray job with the real tiny model, two steps: every episode runs through the framework (or fails as a
  counted failure with its reason), the trajectories hold the sampled tokens, and the learner trains on them.
"""
from __future__ import annotations

import pytest

from tests.loop.conftest import PLUGINS, job_config
from tests.loop.test_multiturn import IM_END, call_text, run_session

pytestmark = pytest.mark.timeout(300)

FRAMEWORKS = {"openai_agents": "openai_agents_tictactoe.py", "langgraph": "langgraph_tictactoe.py"}
BOARD = "X...O...."  # squares 1 and 5 taken; 9 is legal


def load_plugin(framework: str):
    from rlsys.plugins import load_agent

    return load_agent(str(PLUGINS / FRAMEWORKS[framework]))


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def test_openai_kwargs_give_chat_openai_the_session_headers_and_the_workers_pool():
    import httpx
    import openai
    from langchain_openai import ChatOpenAI

    from rlsys.agents import openai_kwargs

    pool = httpx.AsyncClient()
    client = openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="k", max_retries=0, http_client=pool,
                                default_headers={"X-Rlsys-Session": "s", "X-Rlsys-Attempt": "a"})
    kwargs = openai_kwargs(client)
    assert kwargs == {"base_url": "http://127.0.0.1:9/v1/", "api_key": "k", "http_async_client": pool,
                      "default_headers": {"X-Rlsys-Session": "s", "X-Rlsys-Attempt": "a"}, "max_retries": 0}
    built = ChatOpenAI(model="m", **kwargs).root_async_client
    assert built._client is pool and built.max_retries == 0 and str(built.base_url) == str(client.base_url)
    assert {k: built.default_headers[k] for k in ("X-Rlsys-Session", "X-Rlsys-Attempt")} == {"X-Rlsys-Session": "s",
                                                                                           "X-Rlsys-Attempt": "a"}


SCRIPTS = {  # (sampled text, end token) -> (tool call arguments the reward sees, outcome)
    "legal_move": ((call_text(9), IM_END), ('{"square": 9}', "optimal")),
    "text_answer": (("I take the corner.", IM_END), (None, "no_tool_call")),
    "bad_arguments": (('<tool_call>\n{"name": "choose_square", "arguments": {"square": "x"}}\n</tool_call>', IM_END),
                      ('{"square": "x"}', "parse_error")),
}


@pytest.mark.parametrize("case", SCRIPTS)
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_framework_agent_through_the_proxy_records_one_session_of_sampled_tokens(tokenizer, framework, case):
    from rlsys.envs.tictactoe.dataset import make_item
    from rlsys.envs.tictactoe.reward import outcome

    agent = load_plugin(framework)
    item = make_item(BOARD)

    async def with_turns(item, client, model):  # run_session's shape: output["turns"]
        return {"turns": [], "output": await agent(item, client, model)}

    (text, end), (arguments, expected) = SCRIPTS[case]
    result, rec = run_session(tokenizer, [(text, end)], with_turns, item)
    output = result["output"]
    calls = [c["arguments"] for c in output["tool_calls"]]
    assert calls == ([arguments] if arguments else []), output
    assert outcome({"item": item, "output": output}) == expected
    assert rec.num_turns == 1 and rec.segment_breaks == 0
    (seg,) = rec.segments
    sampled = tokenizer.decode([t for t, m in zip(seg.input_ids, seg.loss_mask) if m])
    assert sampled == text + end, "the loss mask is not exactly on the sampled tokens"
    assert "choose_square" in tokenizer.decode(seg.input_ids), "the framework did not send the tool"


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_framework_agent_runs_two_training_steps_on_the_tiny_model(ray_local, tmp_path, framework):
    cfg = job_config(tmp_path, "env.num_workers=1", batch_size="2", n_samples="2", max_new_tokens="24",
                     agent_fn=str(PLUGINS / FRAMEWORKS[framework]),
                     reward_fn_path=str(PLUGINS / "spread_tictactoe_reward.py"))

    def check(trajs):
        failed = [t.fail_reason for t in trajs if t.failed]
        # a framework may give up on what the random model wrote; that must be a counted agent failure
        assert all(r.startswith("agent_error") for r in failed), failed
        assert len(failed) < len(trajs), f"every episode failed: {failed}"
        for t in trajs:
            if t.failed:
                continue
            assert t.num_turns == 1 and len(t.segments) == 1, (t.num_turns, t.info["output"])
            (seg,) = t.segments
            assert sum(seg.loss_mask) > 0 and len(seg.rollout_logprobs) == len(seg.input_ids)
            assert set(t.info["output"]) == {"content", "tool_calls", "finish_reason"}

    train_steps(cfg, check)


def train_steps(cfg, check, steps: int = 2) -> None:
    """`steps` steps of the job's loop (rollout, train, push), with `check(trajectories)` after each rollout;
    the learner must train on at least one sequence every step."""
    import ray

    from jobs.job import Job

    job = Job.start(cfg)
    try:
        for step in range(steps):
            traj_refs, summaries = job.rollout(job.data.next_batch(cfg.rollout.batch_size), step=step)
            check(ray.get(traj_refs))
            job.engines.sleep(level=2)
            stats = job.train(traj_refs, summaries)
            assert stats["train/skipped_steps"] == 0 and stats["train/num_sequences"] >= 1, stats
            job.weights.push()
            job.engines.wake()
    finally:
        job.shutdown()
