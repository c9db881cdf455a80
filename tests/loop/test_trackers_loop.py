"""The CPU job with `logging.trackers=["wandb", "mlflow"]`, stopped after 2 steps and resumed to 3: both trackers hold
every step's metrics under TensorBoard's names, in one W&B run id and one MLflow run, read back with each library's
own reader. wandb runs offline: nothing reaches the network."""
from __future__ import annotations

import json

import pytest

from tests.loop.conftest import PLUGINS, job_config
from tests.unit.test_trackers import read_wandb_run, wandb_offline, wandb_run_files  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(400)

NOT_METRICS = {"_step", "_timestamp", "_runtime"}  # W&B's own columns


def test_job_logs_every_step_to_wandb_and_mlflow_and_a_resume_continues_their_runs(ray_local, tmp_path):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from jobs.train import run_training

    def config(max_steps: str, *overrides: str):
        return job_config(tmp_path, 'logging.trackers=["wandb", "mlflow"]', *overrides, max_steps=max_steps,
                          agent_fn=str(PLUGINS / "recording_agent.py"),
                          reward_fn_path=str(PLUGINS / "length_reward.py"))

    run_dir = run_training(config("2"))
    ids = json.loads((run_dir / "trackers.json").read_text())
    run_training(config("3", "checkpoint.resume=auto"))
    assert json.loads((run_dir / "trackers.json").read_text()) == ids, "the resumed run opened new tracker runs"

    rewards = {r["step"]: r["rollout/rewards_mean"]
               for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    assert sorted(rewards) == [0, 1, 2]
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    tb_names = set(events.Tags()["scalars"])
    assert "rollout/rewards_mean" in tb_names and "train/loss" in tb_names

    # MLflow: one run, every step's reward, TensorBoard's names, the resolved config as dotted params
    client = MlflowClient(ids["mlflow_tracking_uri"])
    run = client.get_run(ids["mlflow"])
    assert run.info.status == "FINISHED"
    history = {m.step: m.value for m in client.get_metric_history(ids["mlflow"], "rollout/rewards_mean")}
    assert history == pytest.approx(rewards)
    assert set(run.data.metrics) == tb_names
    assert run.data.params["max_steps"] == "2", "a resumed run changed a logged param"
    assert run.data.params["rollout.batch_size"] == "2" and run.data.params["logging.wandb_mode"] == "offline"

    # W&B: two offline run files (first part, resumed part) of the same run id, for `wandb sync`
    files = wandb_run_files(run_dir)
    assert len(files) == 2
    wandb_rewards, wandb_names = {}, set()
    for run_file in files:
        run_id, config, rows = read_wandb_run(run_file)
        assert run_id == ids["wandb"]
        assert config["rollout.batch_size"] == 2 and config["logging.trackers"] == ["wandb", "mlflow"]
        for step, row in rows.items():
            wandb_names |= set(row) - NOT_METRICS
            if "rollout/rewards_mean" in row:
                wandb_rewards[step] = row["rollout/rewards_mean"]
    assert wandb_rewards == pytest.approx(rewards)
    assert wandb_names == tb_names
