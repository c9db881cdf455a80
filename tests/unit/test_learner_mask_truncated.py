"""`algo.mask_truncated`: trajectories with a turn cut at max_tokens leave the group baseline and the loss."""
from __future__ import annotations

import pytest
import torch

from rlsys.algos import group_advantages
from tests.conftest import job_config
from tests.faults.test_learner_faults import _trajectories

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("mask", [True, False], ids=["masked", "kept"])
def test_cut_off_answers_leave_the_advantages_only_when_masked(tmp_path, tiny_model_path, mask):
    from tests.conftest import make_learner

    trajs = _trajectories()  # one group, rewards 1.0, 0.0, 0.5, -1.0
    trajs[0].truncated_turns = 1  # the best-rewarded answer was cut at max_tokens
    learner = make_learner(job_config(tmp_path, f"algo.mask_truncated={str(mask).lower()}"), tiny_model_path)
    rows, metrics = learner._policy_rows(trajs)

    kept = trajs[1:] if mask else trajs
    assert [r.segment for r in rows] == [t.segments[0] for t in kept]
    rewards = torch.tensor([t.reward for t in kept])
    expected, _ = group_advantages(rewards, torch.zeros(len(kept), dtype=torch.long),
                                   torch.ones(len(kept), dtype=torch.bool), eps=learner.cfg.algo.adv_eps)
    assert [r.advantage for r in rows] == pytest.approx(expected.tolist())
    assert metrics["adv/truncated_masked_frac"] == (0.25 if mask else 0.0)


def test_rollout_metrics_count_trajectories_with_a_cut_turn():
    from rlsys.metrics import rollout_metrics
    from rlsys.types import TrajectorySummary

    def summary(sample: int, truncated: int) -> TrajectorySummary:
        return TrajectorySummary(item_id="b", group=0, sample=sample, reward=0.0, outcome="optimal", failed=False,
                                 fail_reason="", response_len=5, num_turns=3, segment_breaks=0,
                                 truncated_turns=truncated)

    m = rollout_metrics([summary(0, 0), summary(1, 2), summary(2, 0), summary(3, 1)])
    assert m["rollout/truncated_frac"] == 0.5  # trajectories, not turns


def test_a_truncated_penalty_lowers_the_cut_answers_reward_in_the_advantages(tmp_path, tiny_model_path):
    from tests.conftest import make_learner

    trajs = _trajectories()  # one group, rewards 1.0, 0.0, 0.5, -1.0
    trajs[0].truncated_turns = 1  # the best-rewarded answer was cut at max_tokens
    learner = make_learner(job_config(tmp_path, "algo.truncated_penalty=1.5"), tiny_model_path)
    rows, metrics = learner._policy_rows(trajs)

    assert [r.segment for r in rows] == [t.segments[0] for t in trajs]  # nothing left out
    rewards = torch.tensor([1.0 - 1.5, 0.0, 0.5, -1.0])
    expected, _ = group_advantages(rewards, torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.bool),
                                   eps=learner.cfg.algo.adv_eps)
    assert [r.advantage for r in rows] == pytest.approx(expected.tolist())
    assert rows[0].advantage < 0 and trajs[0].reward == 1.0  # below the baseline now; the logged reward unchanged
    assert metrics["adv/truncated_penalized_frac"] == 0.25 and metrics["adv/truncated_masked_frac"] == 0.0


def test_masking_and_penalising_cut_off_answers_together_is_refused():
    from rlsys.config import load_config

    with pytest.raises(ValueError, match="algo.truncated_penalty: cut-off answers are either left out"):
        load_config(overrides=["algo.mask_truncated=true", "algo.truncated_penalty=1.0"])


def _unanimous_batch():
    """Group 0 with signal (1.0, 0.0, 0.5, -1.0) and group 1 answering the same weaker way 4 times (0.0 each)."""
    import copy

    trajs = _trajectories()
    for t in _trajectories():
        u = copy.deepcopy(t)
        u.group, u.reward = 1, 0.0
        trajs.append(u)
    return trajs


@pytest.mark.parametrize("baseline", ["none", "batch"])
def test_a_unanimous_group_is_trained_only_with_the_batch_baseline(tmp_path, tiny_model_path, baseline):
    from tests.conftest import make_learner

    trajs = _unanimous_batch()
    learner = make_learner(job_config(tmp_path, f"algo.unanimous_baseline={baseline}"), tiny_model_path)
    rows, metrics = learner._policy_rows(trajs)
    signal, unanimous = [r.advantage for r in rows[:4]], [r.advantage for r in rows[4:]]
    expected, _ = group_advantages(torch.tensor([1.0, 0.0, 0.5, -1.0]), torch.zeros(4, dtype=torch.long),
                                   torch.ones(4, dtype=torch.bool), eps=learner.cfg.algo.adv_eps)
    assert signal == pytest.approx(expected.tolist())  # the group with signal: its own baseline either way
    if baseline == "none":
        assert unanimous == [0.0] * 4 and "adv/unanimous_frac" not in metrics
    else:  # 0.0 against the batch mean 0.0625 of the eight: below it, pushed down
        rewards = torch.tensor([t.reward for t in trajs])
        below = float((0.0 - rewards.mean()) / (rewards.std() + learner.cfg.algo.adv_eps))
        assert unanimous == pytest.approx([below] * 4) and below < 0
        assert metrics["adv/unanimous_frac"] == 0.5
    stats = learner.train(trajs)
    assert stats["train/active_frac"] == (1.0 if baseline == "batch" else 0.5)
    assert learner.last_trained()[4:] == ([t.segments[0] for t in trajs[4:]] if baseline == "batch" else [])


def test_the_learner_passes_advantage_scaling_and_positive_weight_to_the_advantages(tmp_path, tiny_model_path):
    from tests.conftest import make_learner

    trajs = _trajectories()  # one group, rewards 1.0, 0.0, 0.5, -1.0
    overrides = ["algo.scale_advantages=false", "algo.positive_weight=0.25"]
    learner = make_learner(job_config(tmp_path, *overrides), tiny_model_path)
    rows, _ = learner._policy_rows(trajs)
    deviations = [1.0 - 0.125, 0.0 - 0.125, 0.5 - 0.125, -1.0 - 0.125]  # unscaled: reward - group mean
    assert [r.advantage for r in rows] == pytest.approx([d * 0.25 if d > 0 else d for d in deviations])


def test_advantage_options_are_refused_for_sft():
    from rlsys.config import load_config

    for override in ("algo.positive_weight=0.5", "algo.scale_advantages=false"):
        with pytest.raises(ValueError, match="GSPO/GRPO only"):
            load_config(overrides=["algo.name=sft", override])
