"""`rollout.overlap` in the real loop (local Ray, tiny model): the next step's rollout runs while the learner
trains, so from the second step on the batch was sampled with the weights of before the previous update (the
learner's logprobs then differ from the engine's by that update, where without overlap they agree); checkpoints
keep the data cursor of before the rollout sampled ahead, so a resumed job samples those boards again."""
from __future__ import annotations

import pytest

from tests.loop.conftest import PLUGINS, job_config

pytestmark = pytest.mark.timeout(600)


def _cursor(run_dir, step: int) -> int:
    from rlsys.checkpoint import read_trainer_state

    state = read_trainer_state(run_dir / "checkpoints" / f"step_{step:06d}")["data"]
    return state["epoch"] * state["num_items"] + state["position"]


def test_the_rollout_ahead_is_one_update_old_and_checkpoints_keep_the_cursor_before_it(ray_local, tmp_path):
    from jobs.train import run_training
    from rlsys.metrics import read_metrics

    plugins = {"agent_fn": str(PLUGINS / "recording_agent.py"), "reward_fn_path": str(PLUGINS / "length_reward.py")}
    common = ["checkpoint.save_interval=1", "checkpoint.keep=5", "algo.logp_mode=bypass"]
    rows = {}
    for overlap in (False, True):
        cfg = job_config(tmp_path / str(overlap), *common, f"rollout.overlap={str(overlap).lower()}", **plugins)
        run_dir = run_training(cfg)
        rows[overlap] = read_metrics(run_dir / "metrics.jsonl")
        assert [r["step"] for r in rows[overlap]] == [0, 1, 2]
        # batch_size 2: each step's rollout takes 2 boards; a checkpoint after step k holds 2k, not 2k + 2 even
        # while step k+1's boards were already sampled ahead
        assert [_cursor(run_dir, k) for k in (1, 2, 3)] == [2, 4, 6]
    on, off = rows[True], rows[False]
    assert [r["rollout/off_policy_steps"] for r in on] == [0.0, 1.0, 1.0]
    assert all("time/rollout_sampling" in r for r in on[1:]) and "time/rollout_sampling" not in on[0]
    assert all("rollout/off_policy_steps" not in r for r in off)
    # step 0 is sampled and trained on the same weights either way; from step 1 on, with overlap, the learner has
    # taken one update (lr 1e-3) since the engine sampled the batch
    assert on[0]["train/logp_diff_mean"] < 1e-3 and max(r["train/logp_diff_mean"] for r in off) < 1e-3
    assert min(r["train/logp_diff_mean"] for r in on[1:]) > 10 * max(r["train/logp_diff_mean"] for r in off)
