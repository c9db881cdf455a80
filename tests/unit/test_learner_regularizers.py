"""The learner's `train/entropy`, `algo.entropy_coef` (a bonus) and `algo.kl_coef` (k3 KL to a frozen reference)."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import job_config
from tests.faults.test_learner_faults import _trajectories

pytestmark = pytest.mark.timeout(300)


def _same_reward(trajs):
    """One group whose rewards all agree: no advantage, no policy-gradient signal."""
    for t in trajs:
        t.reward = 0.5
    return trajs


def _entropy_now(learner) -> float:
    rows, _ = learner._policy_rows(_trajectories())
    return learner._logp_diff(rows)["train/entropy"]


@pytest.mark.parametrize("sharing", [True, False], ids=["prefix-sharing", "plain"])
def test_entropy_is_logged_by_default_and_nothing_else_changes(tmp_path, tiny_model_path, sharing):
    from tests.conftest import make_learner

    learner = make_learner(job_config(tmp_path, f"learner.prefix_sharing={str(sharing).lower()}"), tiny_model_path)
    assert learner.ref_model is None  # kl_coef = 0: no reference loaded
    stats = learner.train(_trajectories())
    assert 0.0 < stats["train/entropy"] < torch.log(torch.tensor(learner.model.config.vocab_size)).item()
    assert "train/kl_ref" not in stats
    # a step without signal still measures it (on the stale-weights alarm's forward), and moves nothing
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    idle = learner.train(_same_reward(_trajectories()))
    assert idle["train/entropy"] > 0.0 and idle["train/active_frac"] == 0.0
    assert all(torch.equal(p, before[n]) for n, p in learner.model.named_parameters())


def test_entropy_bonus_moves_a_batch_without_signal_towards_more_entropy(tmp_path, tiny_model_path):
    from tests.conftest import make_learner

    learner = make_learner(job_config(tmp_path, "algo.entropy_coef=1.0"), tiny_model_path)
    start = _entropy_now(learner)
    for _ in range(3):
        stats = learner.train(_same_reward(_trajectories()))
        assert stats["train/active_frac"] == 1.0  # every sequence ran: the bonus has a gradient on each
    assert _entropy_now(learner) > start + 1e-4


def test_kl_penalty_loads_a_frozen_reference_and_measures_the_drift(tmp_path, tiny_model_path):
    from tests.conftest import make_learner

    learner = make_learner(job_config(tmp_path, "algo.kl_coef=0.1"), tiny_model_path)
    ref = learner.ref_model
    assert ref is not None and not ref.training
    assert all(not p.requires_grad for p in ref.parameters())
    frozen = {n: p.detach().clone() for n, p in ref.named_parameters()}
    first = learner.train(_trajectories())
    assert first["train/kl_ref"] == pytest.approx(0.0, abs=1e-6)  # the policy is still the reference
    for _ in range(2):
        later = learner.train(_trajectories())
    assert later["train/kl_ref"] > 1e-6
    for name, p in ref.named_parameters():  # the reference did not move
        assert torch.equal(p, frozen[name]), f"{name}: the reference moved"


def test_kl_penalty_alone_moves_no_weights_while_the_policy_is_the_reference(tmp_path, tiny_model_path):
    from tests.conftest import make_learner

    learner = make_learner(job_config(tmp_path, "algo.kl_coef=1.0"), tiny_model_path)
    stats = learner.train(_same_reward(_trajectories()))
    assert stats["train/active_frac"] == 1.0 and stats["train/kl_ref"] == 0.0
    assert stats["train/grad_norm"] == 0.0  # k3's gradient vanishes at policy == reference


def test_a_resumed_learner_compares_against_the_initial_model_not_the_checkpoint(tmp_path, tiny_model_path):
    from tests.conftest import make_learner

    cfg = job_config(tmp_path, "algo.kl_coef=0.1")
    trained = make_learner(cfg, tiny_model_path)
    for _ in range(2):
        trained.train(_trajectories())
    ckpt = tmp_path / "ckpt"
    trained.save_state(ckpt)

    resumed = make_learner(cfg, str(ckpt))  # what the job does on --resume: the policy from the checkpoint
    resumed.load_state(ckpt)
    initial = make_learner(job_config(tmp_path), tiny_model_path).model.state_dict()
    for name, p in resumed.ref_model.state_dict().items():
        assert torch.equal(p, initial[name]), f"{name}: the reference is not the initial model"
    assert resumed.train(_trajectories())["train/kl_ref"] > 1e-6  # the policy kept its distance from it


def test_sft_refuses_the_regularizers(tmp_path):
    with pytest.raises(Exception, match="GSPO/GRPO only"):
        job_config(tmp_path, "algo.name=sft", "algo.kl_coef=0.1", "rollout.n_samples=1")


def test_top_entropy_frac_trains_on_the_selected_tokens_and_1_is_the_default_step(tmp_path, tiny_model_path):
    from tests.conftest import make_learner

    def one_step(*overrides):
        learner = make_learner(job_config(tmp_path, *overrides), tiny_model_path)
        stats = learner.train(_trajectories())
        return stats, {n: p.detach().clone() for n, p in learner.model.named_parameters()}

    base, w_base = one_step("algo.kl_coef=0.1")
    full, w_full = one_step("algo.kl_coef=0.1", "algo.top_entropy_frac=1.0")
    top, w_top = one_step("algo.kl_coef=0.1", "algo.top_entropy_frac=0.25")
    assert full["train/selected_token_frac"] == 1.0 and "train/selected_token_frac" not in base
    assert all(torch.equal(w_full[n], w_base[n]) for n in w_base)  # every token selected: the default step
    assert 0.0 < top["train/selected_token_frac"] <= 0.3  # a quarter, ties at the threshold kept
    assert any(not torch.equal(w_top[n], w_base[n]) for n in w_base)  # it trained, on fewer tokens
