"""grpo_loss (token-level ratio, DAPO token-mean) against hand-computed values."""
import math

import pytest
import torch

from rlsys.algos import GRPOConfig, grpo_loss, grpo_normalizer


def _logp_pair(diffs):
    """logp_new (with grad) and logp_old such that logp_new - logp_old == diffs."""
    diffs = torch.tensor(diffs, dtype=torch.float64)
    logp_old = torch.full_like(diffs, -2.0)
    return (logp_old + diffs).requires_grad_(True), logp_old


def _grad(loss, x):
    (g,) = torch.autograd.grad(loss, x)
    return g


ALL = torch.ones(2, 3, dtype=torch.bool)
LN15, LN05 = math.log(1.5), math.log(0.5)


def test_token_level_clipping_on_both_sides():
    # Both sequences have token ratios 1, 1.5, 0.5; clip range [0.8, 1.28].
    # A = +1: objectives 1, 1.28 (clipped high: no grad), 0.5 (below range, unclipped for A > 0)
    # A = -1: objectives -1, -1.5 (above range, unclipped for A < 0), -0.8 (clipped low: no grad)
    logp_new, logp_old = _logp_pair([[0.0, LN15, LN05], [0.0, LN15, LN05]])
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, m = grpo_loss(logp_new, logp_old, adv, ALL, GRPOConfig())
    assert float(loss.detach()) == pytest.approx(-(1 + 1.28 + 0.5 - 1 - 1.5 - 0.8) / 6)  # 0.0866667
    # d loss / d logp[i, t] = -A_i r_i,t / 6 where unclipped, 0 where clipped
    expected = torch.tensor([[-1 / 6, 0.0, -0.5 / 6], [1 / 6, 1.5 / 6, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(_grad(loss, logp_new), expected)
    assert m["train/clip_frac_high"] == pytest.approx(1 / 6)
    assert m["train/clip_frac_low"] == pytest.approx(1 / 6)
    assert m["train/clip_frac"] == pytest.approx(2 / 6)
    assert m["train/ratio_mean"] == pytest.approx(1.0)
    assert m["train/ratio_std"] == pytest.approx(math.sqrt(1 / 6))
    assert m["train/logp_diff_mean"] == pytest.approx((LN15 - LN05) / 3)


def test_token_mean_over_the_batch_not_mean_of_sequence_means():
    # first step (r = 1): seq 0 has 1 token with A = +1, seq 1 has 3 tokens with A = -1.
    # token mean: -(1 - 3) / 4 = 0.5   (a mean of sequence means would give 0)
    logp_new, logp_old = _logp_pair([[0.0] * 3] * 2)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    loss, _ = grpo_loss(logp_new, logp_old, torch.tensor([1.0, -1.0], dtype=torch.float64), mask)
    assert float(loss.detach()) == pytest.approx(0.5)
    expected = torch.tensor([[-0.25, 0.0, 0.0], [0.25, 0.25, 0.25]], dtype=torch.float64)
    torch.testing.assert_close(_grad(loss, logp_new), expected)


def test_tis_weight_is_per_token_and_capped():
    # r = 1; logp_old - logp_rollout = 1.0 (exp 2.718 -> capped 2.0) and -0.5 (0.60653) per token
    logp_new, logp_old = _logp_pair([[0.0, 0.0]])
    logp_rollout = logp_old - torch.tensor([[1.0, -0.5]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    cfg = GRPOConfig(tis_cap=2.0)
    loss, m = grpo_loss(logp_new, logp_old, torch.tensor([1.0], dtype=torch.float64), mask, cfg, logp_rollout)
    w = math.exp(-0.5)
    assert float(loss.detach()) == pytest.approx(-(2.0 + w) / 2)
    torch.testing.assert_close(_grad(loss, logp_new), torch.tensor([[-1.0, -w / 2]], dtype=torch.float64))
    assert m["train/tis_weight_mean"] == pytest.approx((2.0 + w) / 2)


def test_padding_affects_nothing():
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    results = []
    for pad in (0.0, 50.0, float("nan"), float("inf")):
        logp_new, logp_old = _logp_pair([[0.0, LN15, pad], [pad, LN15, LN05]])
        loss, m = grpo_loss(logp_new, logp_old, adv, mask, GRPOConfig(tis_cap=2.0), logp_rollout=logp_old)
        results.append((float(loss.detach()), _grad(loss, logp_new), m))
    for loss, grad, m in results:
        # tokens: +1 * (1, 1.28) and -1 * (1.5, 0.8) -> -(1 + 1.28 - 1.5 - 0.8) / 4
        assert loss == pytest.approx(-(1 + 1.28 - 1.5 - 0.8) / 4)
        assert grad[~mask].abs().max() == 0.0
        torch.testing.assert_close(grad, results[0][1])
        assert m == results[0][2]


def test_gradient_accumulation_with_normalizer_equals_one_batch():
    torch.manual_seed(0)
    diffs = 0.3 * torch.randn(4, 5, dtype=torch.float64)
    mask = torch.rand(4, 5) < 0.6
    mask[0] = True  # unequal token counts per micro-batch
    adv = torch.tensor([1.0, -0.5, 0.3, -1.2], dtype=torch.float64)
    logp_new, logp_old = _logp_pair(diffs.tolist())
    full, _ = grpo_loss(logp_new, logp_old, adv, mask)
    norm = grpo_normalizer(mask)
    summed = sum(
        grpo_loss(logp_new[p], logp_old[p], adv[p], mask[p], normalizer=norm)[0]
        for p in (slice(0, 1), slice(1, 4))
    )
    torch.testing.assert_close(summed, full)
    torch.testing.assert_close(_grad(summed, logp_new), _grad(full, logp_new))
