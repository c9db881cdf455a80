"""Dynamic sampling in the real loop (local Ray, tiny model): groups without signal are dropped and topped up,
counted every step, the data cursor counts every fresh board sampled and a resumed run continues after them, the
curriculum's queue (`data.signal_replay`) holds only boards with signal; a reward that never differs ends each step
at the cap with the update skipped, not a crash."""
from __future__ import annotations

import pytest

from tests.loop.conftest import PLUGINS, job_config

pytestmark = pytest.mark.timeout(600)

GROUP_METRICS = ["rollout/groups_sampled", "rollout/groups_kept", "rollout/groups_surplus",
                 "rollout/zero_var_group_frac", "rollout/sample_rounds"]


def _state(run_dir, step: int) -> dict:
    from rlsys.checkpoint import read_trainer_state

    return read_trainer_state(run_dir / "checkpoints" / f"step_{step:06d}")["data"]


def _cursor(run_dir, step: int) -> int:
    state = _state(run_dir, step)
    return state["epoch"] * state["num_items"] + state["position"]


def test_dynamic_sampling_keeps_only_groups_with_signal_and_the_cursor_resumes_after_the_top_ups(
        ray_local, tmp_path, capsys):
    from jobs.items import load_items
    from jobs.train import run_training
    from rlsys.metrics import read_metrics
    from rlsys.plugins import load_function

    settled = load_function(f"{PLUGINS / 'settled_reward.py'}:settled", "reward", "test helper")
    dyn = ["algo.dynamic_sampling=true", "algo.max_sample_rounds=3", "algo.max_oversample=2", "data.signal_replay=0.5"]
    plugins = {"agent_fn": str(PLUGINS / "recording_agent.py"), "reward_fn_path": str(PLUGINS / "settled_reward.py")}
    cfg = job_config(tmp_path, *dyn, max_steps="2", **plugins)
    run_dir = run_training(cfg)
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert all(name in r for name in GROUP_METRICS), f"step {r['step']} lacks a group count"
        assert r["rollout/groups_kept"] <= 2 and r["rollout/sample_rounds"] <= 3
        # the learner saw no group without signal (it measures the same thing after the filter)
        assert r["adv/zero_var_group_frac"] == 0.0, r
        # the rollout metrics describe every trajectory sampled, the dropped groups included
        assert r["rollout/num_trajectories"] == 4 * r["rollout/groups_sampled"]
    assert all(r["rollout/groups_kept"] == 2 for r in rows), "a top-up round did not fill the batch"
    out = capsys.readouterr().out
    assert "groups " in out and " rnd)" in out, "the progress line lacks the group counts"
    fresh = sum(int(r["rollout/groups_sampled"] - r["rollout/boards_replayed"]) for r in rows)
    assert sum(r["rollout/boards_replayed"] for r in rows) >= 1, "step 1 replays a board of step 0"
    assert _cursor(run_dir, 2) == fresh, "the cursor did not advance by every fresh board sampled"
    queue = _state(run_dir, 2)["replay_queue"]
    boards = [item["board"] for item in load_items(cfg.data, cfg.algo.name, cfg.env.environment())]
    assert queue and not any(settled(boards[i]) for i in queue), "a settled board (no signal) was queued"

    # resume: the third step starts from the saved cursor, not from the start of the data
    run_training(job_config(tmp_path, *dyn, "checkpoint.resume=auto", max_steps="3", **plugins))
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert _cursor(run_dir, 3) == fresh + int(rows[2]["rollout/groups_sampled"] - rows[2]["rollout/boards_replayed"])
    # the data's order (seed 0) puts a settled board in a first round by step 2: dropped, then topped up
    assert any(r["rollout/zero_var_group_frac"] > 0 and r["rollout/sample_rounds"] > 1 for r in rows), rows


def test_a_reward_that_never_differs_ends_at_the_cap_and_skips_the_update(ray_local, tmp_path, capsys):
    from jobs.train import run_training
    from rlsys.metrics import read_metrics

    cfg = job_config(tmp_path, "algo.dynamic_sampling=true", "algo.max_sample_rounds=2", "algo.max_oversample=1",
                     max_steps="1", agent_fn=str(PLUGINS / "recording_agent.py"),
                     reward_fn_path=f"{PLUGINS / 'settled_reward.py'}:constant")
    run_dir = run_training(cfg)
    (row,) = read_metrics(run_dir / "metrics.jsonl")
    assert row["rollout/groups_sampled"] == 4 and row["rollout/sample_rounds"] == 2  # 2 boards, then 2 more
    assert row["rollout/groups_kept"] == 0 and row["rollout/zero_var_group_frac"] == 1.0
    assert row["train/skipped_batch"] == 1.0
    assert "none of 4 groups sampled in 2 round(s)" in capsys.readouterr().out
    assert _cursor(run_dir, 1) == 4


def test_a_collapsed_run_is_said_and_with_stop_on_collapse_ends_with_its_checkpoint(ray_local, tmp_path, capsys):
    """`algo.collapse_steps`: every group unanimous (a constant reward) two steps in a row; the job warns, and with
    `algo.stop_on_collapse` stops there instead of running to `max_steps`, keeping its final checkpoint."""
    from jobs.train import run_training
    from rlsys.metrics import read_metrics

    cfg = job_config(tmp_path, "algo.collapse_steps=2", "algo.stop_on_collapse=true", max_steps="6",
                     agent_fn=str(PLUGINS / "recording_agent.py"),
                     reward_fn_path=f"{PLUGINS / 'settled_reward.py'}:constant")
    run_dir = run_training(cfg)
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["rollout/unanimous_streak"] for r in rows if "rollout/unanimous_streak" in r] == [1.0, 2.0]
    out = capsys.readouterr().out
    assert "WARNING the policy has collapsed: every group of the last 2 steps was unanimous" in out
    assert "algo.stop_on_collapse: training stops after step 2" in out
    assert (run_dir / "checkpoints" / "step_000002").is_dir()
    assert not (run_dir / "checkpoints" / "step_000003").exists()


@pytest.mark.parametrize("baseline", ["batch", "batch_below"])
def test_unanimous_groups_reach_the_learner_with_the_batch_baseline(ray_local, tmp_path, baseline):
    """`algo.unanimous_groups`: settled boards (every sample 0.5) pass the filter, up to 2 a step, and the learner
    gives them the batch baseline (the unsettled boards' rewards differ from 0.5, so it is not 0; under
    `batch_below` only where 0.5 is under the batch's mean)."""
    from jobs.train import run_training
    from rlsys.metrics import read_metrics

    cfg = job_config(tmp_path, "algo.dynamic_sampling=true", "algo.max_sample_rounds=3", "algo.max_oversample=2",
                     f"algo.unanimous_baseline={baseline}", "algo.unanimous_groups=2", max_steps="2",
                     agent_fn=str(PLUGINS / "recording_agent.py"), reward_fn_path=str(PLUGINS / "settled_reward.py"))
    rows = read_metrics(run_training(cfg) / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["rollout/groups_kept"] <= 2 and r["rollout/groups_unanimous_kept"] <= 2
        # what the learner got: the kept groups with signal and the unanimous ones, nothing else
        total = r["rollout/groups_kept"] + r["rollout/groups_unanimous_kept"]
        assert r["adv/zero_var_group_frac"] == pytest.approx(r["rollout/groups_unanimous_kept"] / total), r
        assert r["adv/unanimous_frac"] == pytest.approx(r["rollout/groups_unanimous_kept"] / total), r
        if baseline == "batch" and r["rollout/groups_kept"] and r["rollout/groups_unanimous_kept"]:
            assert r["train/active_frac"] == 1.0, r  # a nonzero advantage for every member
    assert any(r["rollout/groups_unanimous_kept"] > 0 for r in rows), "no settled board was sampled in two steps"
