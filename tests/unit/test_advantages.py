"""group_advantages against hand-computed values (sample std, failed trajectories excluded)."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlsys.algos import group_advantages


def _adv(rewards, groups, valid=None, **kw):
    r = torch.tensor(rewards, dtype=torch.float32)
    g = torch.tensor(groups, dtype=torch.long)
    v = torch.ones(len(rewards), dtype=torch.bool) if valid is None else torch.tensor(valid)
    return group_advantages(r, g, v, **kw)


def test_two_groups_sample_std():
    # group 7: rewards 1,0,0,1 -> mean 0.5, sample var = 4 * 0.25 / 3 = 1/3 -> A = +-0.5 / sqrt(1/3)
    # group 3: rewards 2,4    -> mean 3,   sample var = (1 + 1) / 1 = 2   -> A = -+1 / sqrt(2)
    adv, _ = _adv([1.0, 2.0, 0.0, 0.0, 4.0, 1.0], [7, 3, 7, 7, 3, 7], eps=0.0)
    a = 0.5 / math.sqrt(1 / 3)  # 0.8660254
    b = 1 / math.sqrt(2)  # 0.7071068
    torch.testing.assert_close(adv, torch.tensor([a, -b, -a, -a, b, a]))


def test_eps_is_added_to_std():
    adv, _ = _adv([2.0, 4.0], [0, 0], eps=0.5)
    # std = sqrt(2) -> A = -+1 / (1.41421 + 0.5)
    torch.testing.assert_close(adv, torch.tensor([-1 / 1.9142136, 1 / 1.9142136]))


def test_unscaled_is_reward_minus_group_mean():
    adv, _ = _adv([1.0, 0.0, 0.0, 1.0], [0, 0, 0, 0], scale=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_zero_variance_group_gets_exact_zeros():
    # 0.1 is not exactly representable: mean - r would be rounding noise, divided by eps -> not 0.
    adv, metrics = _adv([0.1, 0.1, 0.1, 1.0, 0.0], [0, 0, 0, 1, 1], eps=1e-6)
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    assert not torch.isnan(adv).any()
    assert metrics["adv/zero_var_group_frac"] == 0.5


def test_failed_trajectories_excluded_from_group_stats():
    # valid rewards 1, 0, 0.5 -> mean 0.5, sample var (0.25 + 0.25 + 0) / 2 = 0.25 -> std 0.5.
    # The failed one (NaN reward) must neither shift the mean (scoring it 0 would give mean 0.375)
    # nor receive an advantage.
    adv, metrics = _adv(
        [1.0, 0.0, float("nan"), 0.5], [0, 0, 0, 0], valid=[True, True, False, True], eps=0.0
    )
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0, 0.0]))
    assert metrics["adv/valid_frac"] == 0.75


def test_single_valid_member_and_all_failed_groups_get_zero():
    adv, metrics = _adv(
        [1.0, 5.0, 3.0, 4.0], [0, 0, 1, 1], valid=[True, False, False, False]
    )
    assert adv.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert metrics["adv/zero_var_group_frac"] == 1.0


def test_metrics_by_hand():
    # group 0: 1,0 -> A = +-1/sqrt(2) (eps 0); group 1: 2,2 -> zero variance; one failed in group 1.
    _, metrics = _adv([1.0, 0.0, 2.0, 2.0, 9.0], [0, 0, 1, 1, 1], valid=[1, 1, 1, 1, 0], eps=0.0)
    assert metrics["adv/zero_var_group_frac"] == 0.5
    assert metrics["adv/valid_frac"] == 0.8
    # mean |A| over the 4 valid: (0.70711 * 2 + 0 + 0) / 4
    assert metrics["adv/abs_mean"] == pytest.approx(2 * 0.70710678 / 4)


def test_empty_batch():
    adv, metrics = _adv([], [])
    assert adv.shape == (0,)
    assert metrics["adv/valid_frac"] == 0.0


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.floats(-1, 1, width=32), st.booleans()), min_size=1, max_size=12
    ),
    st.permutations(list(range(12))),
)
def test_valid_advantages_sum_to_zero_per_group_and_order_does_not_matter(rows, perm):
    groups, rewards, valid = zip(*rows)
    adv, _ = _adv(list(rewards), list(groups), valid=list(valid))
    assert torch.isfinite(adv).all()
    for g in set(groups):
        in_group = torch.tensor([gi == g for gi in groups]) & torch.tensor(valid)
        assert float(adv[in_group].sum()) == pytest.approx(0.0, abs=1e-4)
    order = [i for i in perm if i < len(rows)]
    shuffled, _ = _adv(
        [rewards[i] for i in order], [groups[i] for i in order], valid=[valid[i] for i in order]
    )
    torch.testing.assert_close(shuffled, adv[order])


def test_unanimous_groups_get_the_batch_baseline_and_groups_with_signal_keep_their_own():
    # group 0 has signal (1, 0); group 1 answers 0 every time (a weaker move), group 2 always 1; one failed member
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    groups = [0, 0, 1, 1, 2, 2, 2]
    valid = [True, True, True, True, True, True, False]
    none, m_none = _adv(rewards, groups, valid, eps=0.0)
    batch, m = _adv(rewards, groups, valid, eps=0.0, unanimous="batch")
    torch.testing.assert_close(batch[:2], none[:2])  # the group with signal: its own baseline
    r = torch.tensor(rewards[:6])
    expected = (r - r.mean()) / r.std()  # mean 0.5 over the six valid, sample std
    torch.testing.assert_close(batch[2:6], expected[2:6])
    assert (batch[2:4] < 0).all() and (batch[4:6] > 0).all()  # the weaker answer down, the better one up
    assert batch[6] == 0.0 and none[2:].abs().sum() == 0.0  # failed: never; "none": unanimous groups teach nothing
    assert m["adv/unanimous_frac"] == pytest.approx(4 / 6) and "adv/unanimous_frac" not in m_none
    assert m["adv/zero_var_group_frac"] == m_none["adv/zero_var_group_frac"] == pytest.approx(2 / 3)


def test_batch_below_pushes_unanimous_answers_down_only():
    # as above: group 0 has signal, group 1 answers 0 every time (below the batch), group 2 always 1 (above)
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    groups = [0, 0, 1, 1, 2, 2, 2]
    valid = [True, True, True, True, True, True, False]
    batch, _ = _adv(rewards, groups, valid, eps=0.0, unanimous="batch")
    below, m = _adv(rewards, groups, valid, eps=0.0, unanimous="batch_below")
    torch.testing.assert_close(below[:2], batch[:2])  # the group with signal: its own baseline, both signs
    assert (below[:2] > 0).any() and (below[:2] < 0).any()
    torch.testing.assert_close(below[2:4], batch[2:4])  # the unanimous answer below the batch: the same push down
    assert (below[2:4] < 0).all()
    assert (batch[4:6] > 0).all() and below[4:6].abs().sum() == 0.0  # the one above: not raised
    assert below[6] == 0.0
    assert m["adv/unanimous_frac"] == pytest.approx(4 / 6)


def test_the_batch_baseline_gives_nothing_when_the_whole_batch_agrees_or_has_one_valid_member():
    adv, m = _adv([1.0, 1.0, 1.0, 1.0], [0, 0, 1, 1], unanimous="batch")
    assert adv.abs().sum() == 0.0 and m["adv/unanimous_frac"] == 1.0
    adv, _ = _adv([1.0, 0.0], [0, 1], [True, False], unanimous="batch")
    assert adv.abs().sum() == 0.0
    with pytest.raises(ValueError, match="unanimous must be"):
        _adv([1.0, 0.0], [0, 0], unanimous="group")


def test_positive_weight_scales_only_the_positive_advantages_after_either_baseline():
    rewards, groups = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0], [0, 0, 1, 1, 2, 2]  # group 0 has signal, 1 and 2 unanimous
    for unanimous in ("none", "batch", "batch_below"):
        full, _ = _adv(rewards, groups, unanimous=unanimous)
        weighted, m = _adv(rewards, groups, unanimous=unanimous, positive_weight=0.1)
        torch.testing.assert_close(weighted, torch.where(full > 0, 0.1 * full, full))
        assert (full > 0).any() and (full < 0).any()  # both signs were there to tell apart
        assert m["adv/abs_mean"] == pytest.approx(float(weighted.abs().mean()))
    negative_only, _ = _adv(rewards, groups, unanimous="batch", positive_weight=0.0)
    assert (negative_only <= 0).all() and (negative_only < 0).sum() == 3  # NSR: the 0-reward answers only
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="positive_weight must be in"):
            _adv(rewards, groups, positive_weight=bad)
