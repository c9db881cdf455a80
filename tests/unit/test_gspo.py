"""gspo_loss against hand-computed values: 2 sequences x 3 tokens unless said otherwise."""
import math

import pytest
import torch

from rlsys.algos import GSPOConfig, group_advantages, gspo_loss, gspo_normalizer, token_logprobs

WIDE = GSPOConfig(clip_eps_low=0.2, clip_eps_high=0.1, tis_cap=None)


def _logp_pair(diffs, old=None):
    """logp_new (with grad) and logp_old such that logp_new - logp_old == diffs."""
    diffs = torch.tensor(diffs, dtype=torch.float64)
    logp_old = torch.full_like(diffs, -1.5) if old is None else torch.tensor(old, dtype=torch.float64)
    logp_new = (logp_old + diffs).requires_grad_(True)
    return logp_new, logp_old


def _grad(loss, x):
    (g,) = torch.autograd.grad(loss, x)
    return g


ALL = torch.ones(2, 3, dtype=torch.bool)


def test_unclipped_value_and_gradient():
    # seq 0: token diffs 0.1, 0, -0.04 -> mean 0.02 -> s0 = exp(0.02); seq 1: s1 = exp(-0.03)
    logp_new, logp_old = _logp_pair([[0.1, 0.0, -0.04], [-0.03, -0.03, -0.03]])
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, m = gspo_loss(logp_new, logp_old, adv, ALL, WIDE)
    s0, s1 = math.exp(0.02), math.exp(-0.03)
    assert float(loss.detach()) == pytest.approx(-(1.0 * s0 - 1.0 * s1) / 2)
    # d loss / d logp_new[i, t] = -(1/B) A_i s_i (1/|y_i|)
    expected = torch.tensor([[-s0 / 6] * 3, [s1 / 6] * 3], dtype=torch.float64)
    torch.testing.assert_close(_grad(loss, logp_new), expected)
    assert m["train/ratio_mean"] == pytest.approx((s0 + s1) / 2)
    assert m["train/ratio_std"] == pytest.approx(abs(s0 - s1) / 2)
    assert m["train/clip_frac"] == 0.0
    assert m["train/logp_diff_mean"] == pytest.approx((0.1 + 0.0 + 0.04 + 0.09) / 6)


def test_clipped_high_positive_advantage_has_zero_gradient():
    # seq 0: s0 = exp(0.2) = 1.2214 > 1 + 0.1 with A = +1 -> objective 1.1, no gradient.
    # seq 1: s1 = exp(0.05) = 1.0513 inside the range.
    logp_new, logp_old = _logp_pair([[0.2, 0.2, 0.2], [0.05, 0.05, 0.05]])
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    loss, m = gspo_loss(logp_new, logp_old, adv, ALL, WIDE)
    s1 = math.exp(0.05)
    assert float(loss.detach()) == pytest.approx(-(1.1 + s1) / 2)
    grad = _grad(loss, logp_new)
    assert grad[0].abs().max() == 0.0
    torch.testing.assert_close(grad[1], torch.full((3,), -s1 / 6, dtype=torch.float64))
    assert (m["train/clip_frac_high"], m["train/clip_frac_low"], m["train/clip_frac"]) == (0.5, 0.0, 0.5)


def test_clipped_low_negative_advantage_has_zero_gradient():
    # seq 0: s0 = exp(-0.3) = 0.7408 < 1 - 0.2 with A = -1 -> objective -0.8, no gradient.
    # seq 1: the same ratio with A = +1 is *not* clipped (min picks s A): gradient flows.
    logp_new, logp_old = _logp_pair([[-0.3, -0.3, -0.3], [-0.3, -0.3, -0.3]])
    adv = torch.tensor([-1.0, 1.0], dtype=torch.float64)
    loss, m = gspo_loss(logp_new, logp_old, adv, ALL, WIDE)
    s = math.exp(-0.3)
    assert float(loss.detach()) == pytest.approx(-(-0.8 + s) / 2)
    grad = _grad(loss, logp_new)
    assert grad[0].abs().max() == 0.0
    torch.testing.assert_close(grad[1], torch.full((3,), -s / 6, dtype=torch.float64))
    assert (m["train/clip_frac_low"], m["train/clip_frac_high"], m["train/clip_frac"]) == (0.5, 0.0, 0.5)


def test_default_config_clips_at_paper_epsilons():
    # s = exp(1e-3) = 1.0010005 > 1 + 4e-4 -> objective 1.0004 for A = +1
    logp_new, logp_old = _logp_pair([[1e-3, 1e-3, 1e-3]])
    loss, m = gspo_loss(logp_new, logp_old, torch.tensor([1.0], dtype=torch.float64), ALL[:1])
    assert float(loss.detach()) == pytest.approx(-1.0004)
    assert m["train/clip_frac_high"] == 1.0


def test_zero_variance_group_gives_zero_loss_and_zero_gradient():
    adv, _ = group_advantages(torch.tensor([0.8, 0.8]), torch.tensor([0, 0]), torch.tensor([True, True]))
    logp_new, logp_old = _logp_pair([[0.1, -0.2, 0.0], [0.05, 0.0, 0.3]])
    loss, _ = gspo_loss(logp_new, logp_old, adv.double(), ALL, WIDE)
    assert float(loss.detach()) == 0.0
    assert _grad(loss, logp_new).abs().max() == 0.0


def test_tis_weight_is_capped_and_detached():
    # first step (logp_new == logp_old, s = 1); engine logprobs differ:
    # seq 0: mean(logp_old - logp_rollout) = 1.0 -> exp(1) = 2.718 capped at 2.0
    # seq 1: mean = -0.5 -> w = exp(-0.5) = 0.60653
    logp_new, logp_old = _logp_pair([[0.0] * 3] * 2)
    logp_rollout = logp_old - torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, -0.5]], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    cfg = GSPOConfig(tis_cap=2.0)
    loss, m = gspo_loss(logp_new, logp_old, adv, ALL, cfg, logp_rollout=logp_rollout)
    w1 = math.exp(-0.5)
    assert float(loss.detach()) == pytest.approx(-(2.0 + w1) / 2)
    expected = torch.tensor([[-2.0 / 6] * 3, [-w1 / 6] * 3], dtype=torch.float64)
    torch.testing.assert_close(_grad(loss, logp_new), expected)
    assert m["train/tis_weight_mean"] == pytest.approx((2.0 + w1) / 2)
    assert m["train/rollout_logp_diff_mean"] == pytest.approx(0.75)


def test_tis_disabled_by_none_cap_still_logs_the_mismatch():
    logp_new, logp_old = _logp_pair([[0.0] * 3] * 2)
    logp_rollout = logp_old - 1.0
    adv = torch.tensor([1.0, -0.5], dtype=torch.float64)
    loss, m = gspo_loss(logp_new, logp_old, adv, ALL, WIDE, logp_rollout=logp_rollout)
    assert float(loss.detach()) == pytest.approx(-(1.0 - 0.5) / 2)
    assert "train/tis_weight_mean" not in m
    assert m["train/rollout_logp_diff_mean"] == pytest.approx(1.0)


def test_padding_affects_nothing():
    # seq 0 has tokens 0,1 (diffs 0.06, 0 -> mean 0.03); seq 1 tokens 1,2 (diffs -0.02, -0.04 -> -0.03);
    # seq 2 has no token at all and does not count in the mean.
    mask = torch.tensor([[1, 1, 0], [0, 1, 1], [0, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0, 5.0], dtype=torch.float64)
    results = []
    for pad in (0.0, 1e4, float("nan"), float("-inf")):
        diffs = torch.tensor([[0.06, 0.0, pad], [pad, -0.02, -0.04], [pad, pad, pad]])
        logp_new, logp_old = _logp_pair(diffs.tolist())
        old_pad = torch.where(mask, logp_old, torch.full_like(logp_old, pad))
        rollout = old_pad.clone()
        cfg = GSPOConfig(clip_eps_low=0.2, clip_eps_high=0.1, tis_cap=2.0)
        loss, m = gspo_loss(logp_new, old_pad, adv, mask.long(), cfg, logp_rollout=rollout)
        results.append((float(loss.detach()), _grad(loss, logp_new), m))
    s0, s1 = math.exp(0.03), math.exp(-0.03)
    for loss, grad, m in results:
        assert loss == pytest.approx(-(s0 - s1) / 2)
        assert grad[~mask].abs().max() == 0.0
        torch.testing.assert_close(grad, results[0][1])
        assert m == results[0][2]


def test_gradient_accumulation_with_normalizer_equals_one_batch():
    torch.manual_seed(0)
    diffs = 0.05 * torch.randn(5, 4, dtype=torch.float64)
    mask = torch.tensor(
        [[1, 1, 1, 0], [1, 0, 0, 0], [0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool
    )
    adv = torch.tensor([1.0, -0.5, 0.3, -1.2, 2.0], dtype=torch.float64)
    cfg = GSPOConfig(clip_eps_low=0.02, clip_eps_high=0.03)  # some of these ratios clip
    logp_new, logp_old = _logp_pair(diffs.tolist())
    full, _ = gspo_loss(logp_new, logp_old, adv, mask, cfg)
    full_grad = _grad(full, logp_new)

    # micro-batches of 3 (all with tokens) and 2 (one with tokens): unequal counts
    norm = gspo_normalizer(mask)
    assert norm == 4.0
    parts = [slice(0, 3), slice(3, 5)]
    summed = sum(gspo_loss(logp_new[p], logp_old[p], adv[p], mask[p], cfg, normalizer=norm)[0] for p in parts)
    torch.testing.assert_close(summed, full)
    torch.testing.assert_close(_grad(summed, logp_new), full_grad)


def test_first_step_is_sequence_level_reinforce():
    # logp_old == logp_new: s_i = 1, loss = -mean_i A_i, grad = -(1/B) sum_i A_i mean_t grad logp[i, t]
    torch.manual_seed(1)
    logits = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([[0, 3, 1], [4, 4, 2]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([0.7, -1.3], dtype=torch.float64)
    logp_new = token_logprobs(logits, targets)
    loss, m = gspo_loss(logp_new, logp_new.detach(), adv, mask, GSPOConfig())
    assert float(loss.detach()) == pytest.approx(-(0.7 - 1.3) / 2)
    assert m["train/ratio_mean"] == 1.0 and m["train/clip_frac"] == 0.0 and m["train/logp_diff_mean"] == 0.0

    reinforce = -(0.7 * logp_new[0, :3].mean() - 1.3 * logp_new[1, :2].mean()) / 2
    (want,) = torch.autograd.grad(reinforce, logits, retain_graph=True)
    (got,) = torch.autograd.grad(loss, logits)
    torch.testing.assert_close(got, want)


def test_bad_inputs_are_rejected():
    logp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="advantages"):
        gspo_loss(logp, logp, torch.zeros(3), ALL)
    with pytest.raises(ValueError, match="normalizer"):
        gspo_loss(logp, logp, torch.zeros(2), ALL, normalizer=0.0)
    with pytest.raises(ValueError, match="tis_cap"):
        GSPOConfig(tis_cap=0.0)
