"""Env worker and plug-in faults, injected for real under Ray: a worker process that dies mid-episode,
agents that raise, rewards that return garbage; each is counted with its reason and the step goes on."""
from __future__ import annotations

import pytest

from tests.conftest import job_config

pytestmark = pytest.mark.timeout(300)
PLUGINS = __import__("pathlib").Path(__file__).resolve().parent / "plugins"


def _job(tmp_path, plugin: str, *overrides: str, **flags: str):
    from jobs.job import Job

    cfg = job_config(tmp_path, "env.agent_timeout_s=20", *overrides, n_samples="2", mini_bs="2",
                     agent_fn=f"{PLUGINS / plugin}:agent", reward_fn_path=f"{PLUGINS / 'bad_values.py'}:reward", **flags)
    return Job.start(cfg)


def test_worker_killed_mid_episode_is_restarted_and_the_episode_retried_once(ray_local, tmp_path):
    import ray

    job = _job(tmp_path, "dying_agent.py", "env.num_workers=1")
    try:
        worker = job.env_workers[0]
        pid_before = ray.get(worker.pid.remote())
        items = [{"id": "once", "board": "X.O......", "die": "once", "marker": str(tmp_path / "died")},
                 {"id": "ok", "board": "XO......."}]
        refs, summaries = job.rollout(items, step=0)
        assert (tmp_path / "died").exists(), "the agent did not kill its worker"
        assert ray.get(worker.pid.remote()) != pid_before, "Ray did not restart the env worker"
        # the in-flight episodes of the dead worker were retried on the restarted one and completed
        assert [s.failed for s in summaries] == [False] * 4, [s.fail_reason for s in summaries]
        trajs = ray.get(refs)
        assert all(t.num_turns == 1 and t.segment_breaks == 0 for t in trajs), "a retry kept the dead attempt's turns"

        refs, summaries = job.rollout([{"id": "always", "board": "X.O......", "die": "always"}], step=1)
        assert all(s.failed and s.fail_reason.startswith("worker_died") for s in summaries)
        assert all(t.failed for t in ray.get(refs))
    finally:
        job.shutdown()


def test_raising_agent_and_garbage_rewards_are_failed_with_their_reason(ray_local, tmp_path):
    job = _job(tmp_path, "bad_values.py")
    try:
        ids = ["raise", "nan", "inf", "none", "str", "bool", "good"]
        items = [{"id": i, "board": "X.O......"} for i in ids]
        _, summaries = job.rollout(items, step=0)
        reasons = {s.item_id: s.fail_reason for s in summaries}
        assert reasons["raise"].startswith("agent_error: RuntimeError: agent exploded on purpose")
        assert reasons["nan"] == "reward_invalid: returned nan"
        assert reasons["inf"] == "reward_invalid: returned inf"
        for bad in ("none", "str", "bool"):
            assert reasons[bad].startswith("reward_invalid: returned"), reasons[bad]
        assert reasons["good"] == ""
        from rlsys.metrics import rollout_metrics

        m = rollout_metrics(summaries)
        assert m["rollout/failed_frac"] == pytest.approx(12 / 14)
        assert m["error/agent_error"] == pytest.approx(2 / 14)
        assert m["error/reward_invalid"] == pytest.approx(10 / 14)
    finally:
        job.shutdown()


def test_a_step_with_too_many_failures_is_skipped_not_trained_on(ray_local, tmp_path):
    import ray

    job = _job(tmp_path, "bad_values.py", "env.max_failed_frac=0.25")
    try:
        before = ray.get(job.learner.named_weights.remote())
        refs, summaries = job.rollout([{"id": "nan", "board": "X.O......"}, {"id": "good", "board": "XO......."}], step=0)
        stats = job.train(refs, summaries)
        assert stats == {"train/skipped_batch": 1.0}
        after = ray.get(job.learner.named_weights.remote())
        assert all((before[k] == after[k]).all() for k in before)
    finally:
        job.shutdown()


def test_a_reference_actor_that_dies_is_started_again_and_the_batch_still_gets_its_logprobs(ray_local, tmp_path):
    import os
    import signal

    import ray

    job = _job(tmp_path, "dying_agent.py", "algo.kl_coef=0.1", "learner.reference_actor=true")
    try:
        refs, _ = job.rollout([{"id": "ok", "board": "XO......."}], step=0)
        first = ray.get(job.with_reference(refs))
        pid = ray.get(job.reference.__ray_call__.remote(lambda self: os.getpid()))
        os.kill(pid, signal.SIGKILL)  # the process dies between two batches, as a crash would end it
        again = ray.get(job.with_reference(refs))
        assert ray.get(job.reference.__ray_call__.remote(lambda self: os.getpid())) != pid, "not restarted"
        for a, b in zip(first, again):  # the new process's reference is the same model
            assert a.segments[0].ref_logprobs == b.segments[0].ref_logprobs
            assert a.segments[0].ref_logprobs is not None
    finally:
        job.shutdown()
