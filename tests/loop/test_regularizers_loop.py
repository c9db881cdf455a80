"""A job with an entropy bonus and a KL penalty, end to end on CPU: the metrics reach metrics.jsonl every step, and
a resumed job still measures the KL to the initial model (not to the checkpoint it resumed from); with the reference
in the learner, and in its own actor beside an overlapped rollout (`learner.reference_actor`, the README job's)."""
from __future__ import annotations

import pytest

from tests.loop.conftest import PLUGINS, job_config

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("where", [[], ["learner.reference_actor=true", "rollout.overlap=true"]],
                         ids=["in-learner", "reference-actor"])
def test_entropy_and_kl_are_logged_and_the_reference_survives_a_resume(ray_local, tmp_path, where):
    from jobs.train import run_training
    from rlsys.metrics import read_metrics

    reg = ["algo.kl_coef=0.05", "algo.entropy_coef=0.01", *where]
    plugins = {"agent_fn": str(PLUGINS / "recording_agent.py"), "reward_fn_path": str(PLUGINS / "length_reward.py")}
    run_dir = run_training(job_config(tmp_path, *reg, max_steps="2", **plugins))
    run_training(job_config(tmp_path, *reg, "checkpoint.resume=auto", max_steps="3", **plugins))
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["train/entropy"] > 0.0, r["step"]
        assert r["train/active_frac"] == 1.0, "with a regularizer every sequence trains"
    assert rows[0]["train/kl_ref"] == pytest.approx(0.0, abs=1e-6)  # the first forward: policy == reference
    # the first step after the resume: against the checkpoint's own weights the KL would be 0 again
    assert rows[2]["train/kl_ref"] > 1e-6
