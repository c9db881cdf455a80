"""The tic-tac-toe job end to end on CPU: real Ray actors, object store, HTTP proxy, TensorBoard files."""
from __future__ import annotations

import json

import httpx
import pytest
import torch
from safetensors.torch import load_file

from tests.loop.conftest import PLUGINS, job_config

pytestmark = pytest.mark.timeout(300)

METRIC_NAMES = [
    "rollout/rewards_mean", "rollout/response_len_mean", "train/loss", "train/ratio_mean", "train/clip_frac",
    "train/logp_diff_mean", "train/grad_norm", "train/lr", "time/rollout", "time/train", "time/sync",
    "time/step", "perf/tokens_per_s", "rollout/failed_frac", "error/no_tool_call",
]


def test_three_steps_write_metrics_tensorboard_and_change_every_parameter(ray_local, tmp_path, tiny_model_path):
    from jobs.train import run_training
    from rlsys.metrics import read_metrics

    cfg = job_config(tmp_path, agent_fn=str(PLUGINS / "recording_agent.py"),
                     reward_fn_path=str(PLUGINS / "length_reward.py"))
    run_dir = run_training(cfg)

    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for name in METRIC_NAMES:
        assert all(name in r for r in rows), f"metrics.jsonl lacks {name}"
    assert all(r["train/skipped_steps"] == 0 for r in rows)
    assert all(r["train/logp_diff_mean"] < 1e-4 for r in rows), "engine and learner disagree: stale weights?"

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert set(METRIC_NAMES) <= tags
    assert len(events.Scalars("rollout/rewards_mean")) == 3
    assert (run_dir / "config.resolved.toml").is_file()

    # every trained parameter moved away from the initial weights
    start = load_file(f"{tiny_model_path}/model.safetensors")
    final = load_file(str(run_dir / "checkpoints" / "step_000003" / "model.safetensors"))
    assert set(final) == set(start)
    unchanged = [name for name in start if torch.equal(start[name], final[name])]
    assert unchanged == []


def test_engine_samples_are_what_the_learner_trains_on_and_weights_match_after_push(ray_local, tmp_path):
    import ray

    from jobs.job import Job

    cfg = job_config(tmp_path, agent_fn=str(PLUGINS / "recording_agent.py"),
                     reward_fn_path=str(PLUGINS / "length_reward.py"))
    job = Job.start(cfg)
    try:
        items = job.data.next_batch(cfg.rollout.batch_size)
        traj_refs, summaries = job.rollout(items, step=0)
        trajs = ray.get(traj_refs)
        assert len(trajs) == 8 and not any(t.failed for t in trajs)
        for t in trajs:
            (seg,) = t.segments
            out = t.info["output"]
            sampled = [tok for tok, m in zip(seg.input_ids, seg.loss_mask) if m]
            assert sampled == out["sampled_ids"], "recorded tokens differ from what the engine sampled"
            assert seg.input_ids == out["prompt_ids"] + out["sampled_ids"]
            assert seg.loss_mask == [0] * len(out["prompt_ids"]) + [1] * len(out["sampled_ids"])
        job.engines.sleep(level=2)
        stats = job.train(traj_refs, summaries)
        assert stats["train/skipped_steps"] == 0
        trained = ray.get(job.learner.last_trained.remote())
        assert trained, "no sequence had a nonzero advantage"
        by_ids = {tuple(s.input_ids): s for t in trajs for s in t.segments}
        for seg in trained:
            assert tuple(seg.input_ids) in by_ids and by_ids[tuple(seg.input_ids)].loss_mask == seg.loss_mask
        job.weights.push()
        job.engines.wake()
        job.weights.check_canary()
        engine_w = ray.get(job.rollouts[0].named_weights.remote())
        learner_w = ray.get(job.learner.named_weights.remote())
        for name, tensor in learner_w.items():
            assert torch.equal(engine_w[name], tensor), f"{name} differs after the push"
    finally:
        job.shutdown()


def test_raising_reward_and_hanging_agent_fail_their_trajectories_and_the_step_completes(ray_local, tmp_path):
    from jobs.train import run_training
    from rlsys.metrics import read_metrics

    data = tmp_path / "boards.jsonl"
    boards = {"hang": "X.O......", "boom": "XO.......", "ok1": ".........", "ok2": "XOX.O...."}
    data.write_text("".join(json.dumps({"id": k, "board": b}) + "\n" for k, b in boards.items()))
    # the timeout must outlast a healthy episode on a loaded 2-core box, and the 'hang' agent outlasts it
    cfg = job_config(tmp_path, "env.agent_timeout_s=20", "data.shuffle=false", max_steps="1", batch_size="4",
                     n_samples="2", agent_fn=f"{PLUGINS / 'faulty.py'}:agent",
                     reward_fn_path=f"{PLUGINS / 'faulty.py'}:reward", dataset_path=str(data))
    run_dir = run_training(cfg)
    (row,) = read_metrics(run_dir / "metrics.jsonl")
    assert row["rollout/failed_frac"] == pytest.approx(4 / 8)  # both samples of 'hang' and of 'boom'
    assert row["error/agent_timeout"] == pytest.approx(2 / 8)
    assert row["error/reward_error"] == pytest.approx(2 / 8)
    assert row["train/skipped_batch"] == 0.0 and "train/grad_norm" in row


def test_proxy_of_a_running_job_rejects_a_missing_or_wrong_token(ray_local, tmp_path):
    from jobs.job import Job

    job = Job.start(job_config(tmp_path))
    try:
        proxy = job.proxies[0]
        base = proxy["url"]
        assert httpx.get(f"{base}/models", trust_env=False).status_code == 401
        assert httpx.get(f"{base}/models", headers={"Authorization": "Bearer nope"}, trust_env=False).status_code == 401
        assert httpx.post(f"{base}/chat/completions", json={}, trust_env=False).status_code == 401
        ok = httpx.get(f"{base}/models", headers={"Authorization": f"Bearer {proxy['token']}"}, trust_env=False)
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == proxy["model"]
        assert base.startswith("http://127.0.0.1:")
    finally:
        job.shutdown()
