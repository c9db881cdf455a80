"""Dynamic sampling's filter and top-up (rlsys/sampling.py), on hand-made summaries: no Ray, no model."""
from __future__ import annotations

import random

import pytest
import torch

from rlsys.algos.advantages import group_advantages
from rlsys.sampling import GroupSieve, group_signal, top_up_boards
from rlsys.types import TrajectorySummary


def summary(group: int, reward: float, failed: bool = False, response_len: int = 5,
            truncated: int = 0) -> TrajectorySummary:
    return TrajectorySummary(item_id=f"b{group}", group=group, sample=0, reward=reward, outcome="", failed=failed,
                             fail_reason="reward_error: x" if failed else "", response_len=response_len,
                             num_turns=1, segment_breaks=0, truncated_turns=truncated)


def groups(*rewards_per_group: list[float], first: int = 0) -> list[TrajectorySummary]:
    return [summary(first + g, r) for g, rs in enumerate(rewards_per_group) for r in rs]


def test_a_group_whose_rewards_all_agree_has_no_signal_and_one_that_differs_has():
    signal = group_signal(groups([1.0, 1.0, 1.0], [1.0, 0.0, 1.0], [-1.0, -1.0, -1.0], [0.5, 0.5, 0.25]))
    assert signal == {0: False, 1: True, 2: False, 3: True}


def test_failed_empty_and_masked_truncated_members_do_not_count_as_the_advantage_code_says():
    # the only differing reward is a failed one (its value is never read): no signal
    assert group_signal([summary(0, 1.0), summary(0, 1.0), summary(0, 0.0, failed=True)]) == {0: False}
    # one valid member left: no baseline, no signal
    assert group_signal([summary(0, 1.0), summary(0, 0.0, failed=True), summary(0, 0.0, response_len=0)]) == {0: False}
    cut = [summary(0, 1.0), summary(0, 1.0), summary(0, 0.0, truncated=1)]
    assert group_signal(cut) == {0: True}
    assert group_signal(cut, mask_truncated=True) == {0: False}


def test_the_filter_agrees_with_the_advantage_code_on_random_groups():
    """A kept group is exactly one where group_advantages gives some member a nonzero advantage."""
    rng = random.Random(0)
    batch = [summary(g, rng.choice([0.0, 0.5, 1.0]), failed=rng.random() < 0.2, response_len=rng.choice([0, 3, 3, 3]))
             for g in range(200) for _ in range(4)]
    signal = group_signal(batch)
    adv, _ = group_advantages(torch.tensor([s.reward for s in batch]), torch.tensor([s.group for s in batch]),
                              torch.tensor([not s.failed and s.response_len > 0 for s in batch]))
    nonzero = {s.group for s, a in zip(batch, adv.tolist()) if a != 0.0}
    assert {g for g, s in signal.items() if s} == nonzero
    assert 0 < len(nonzero) < 200  # both kinds present


def test_sieve_drops_every_zero_variance_group_and_keeps_every_group_with_signal():
    sieve = GroupSieve(want=4, max_rounds=3)
    sieve.add(groups([1, 1], [0, 1], [1, 1], [0, 0]))  # groups 0..3: only 1 has signal
    assert sieve.kept() == {1}
    assert sieve.groups_seen == 4
    assert sieve.next_round() == 12  # 3 missing at a keep rate of 1/4
    sieve.add(groups(*[[0, 1] if g % 2 else [1, 1] for g in range(12)], first=sieve.groups_seen))
    assert sieve.kept() == {1, 5, 7, 9}  # the first 3 of the 6 with signal: 5, 7, 9; then 11, 13, 15 are surplus
    assert sieve.with_signal == [1, 5, 7, 9, 11, 13, 15]  # the surplus too (`data.signal_replay` queues them)
    assert sieve.next_round() == 0
    assert sieve.metrics() == {"rollout/groups_sampled": 16.0, "rollout/groups_kept": 4.0,
                               "rollout/groups_surplus": 3.0, "rollout/zero_var_group_frac": 9 / 16,
                               "rollout/sample_rounds": 2.0}


def test_a_reward_that_is_always_the_same_ends_at_the_cap_with_nothing_kept():
    sieve = GroupSieve(want=4, max_rounds=3, max_oversample=4.0)
    sizes = []
    boards = 4
    while boards:
        sieve.add(groups(*[[0.5] * 4] * boards, first=sieve.groups_seen))
        sizes.append(boards)
        boards = sieve.next_round()
    assert sizes == [4, 16, 16]  # a top-up round: 4 boards per missing group when nothing was kept
    assert sieve.kept() == set()
    assert sieve.metrics() == {"rollout/groups_sampled": 36.0, "rollout/groups_kept": 0.0,
                               "rollout/groups_surplus": 0.0, "rollout/zero_var_group_frac": 1.0,
                               "rollout/sample_rounds": 3.0}


def test_the_cap_keeps_what_was_found():
    sieve = GroupSieve(want=4, max_rounds=2)
    sieve.add(groups([0, 1], [1, 1], [1, 1], [1, 1]))
    sieve.add(groups(*[[1, 1]] * sieve.next_round(), first=sieve.groups_seen))
    assert sieve.next_round() == 0 and sieve.kept() == {0}
    assert sieve.metrics()["rollout/groups_kept"] == 1.0 and sieve.metrics()["rollout/sample_rounds"] == 2.0


def test_a_full_first_round_needs_no_top_up():
    sieve = GroupSieve(want=2, max_rounds=5)
    sieve.add(groups([0, 1], [1, 0]))
    assert sieve.next_round() == 0 and sieve.kept() == {0, 1}


def test_disabled_keeps_every_group_in_one_round_and_still_counts_zero_variance():
    sieve = GroupSieve(want=3, max_rounds=5, enabled=False)
    sieve.add(groups([1, 1], [0, 1], [0, 0]))
    assert sieve.next_round() == 0 and sieve.kept() == {0, 1, 2}
    assert sieve.with_signal == [1]
    assert sieve.metrics()["rollout/zero_var_group_frac"] == pytest.approx(2 / 3)
    assert sieve.metrics()["rollout/groups_kept"] == 3.0


@pytest.mark.parametrize(("missing", "kept", "sampled", "cap", "boards"), [
    (0, 4, 8, 4.0, 0),  # full
    (3, 1, 4, 4.0, 12),  # keep rate 1/4
    (2, 2, 4, 4.0, 4),  # keep rate 1/2
    (3, 3, 4, 4.0, 4),  # keep rate 3/4: ceil(4.0), no float round-up to 5
    (3, 0, 4, 4.0, 12),  # nothing kept: the cap's rate
    (3, 1, 100, 4.0, 12),  # keep rate 1/100, capped at 4 boards per missing group
    (3, 1, 100, 1.0, 3),  # no oversampling: just the missing boards
])
def test_top_up_size_follows_the_keep_rate_within_the_cap(missing, kept, sampled, cap, boards):
    assert top_up_boards(missing, kept, sampled, cap) == boards


def test_config_fields_defaults_and_sft_refused():
    from rlsys.config import ConfigError, load_config

    cfg = load_config()
    assert (cfg.algo.dynamic_sampling, cfg.algo.max_sample_rounds, cfg.algo.max_oversample) == (False, 3, 4.0)
    cfg = load_config(overrides=["algo.dynamic_sampling=true", "algo.max_sample_rounds=5"])
    assert cfg.algo.dynamic_sampling and cfg.algo.max_sample_rounds == 5
    with pytest.raises(ConfigError, match="algo.max_sample_rounds"):
        load_config(overrides=["algo.max_sample_rounds=0"])
    with pytest.raises(ConfigError, match="algo.dynamic_sampling"):
        load_config(overrides=["algo.name=sft", "algo.dynamic_sampling=true"])


def test_console_line_shows_the_group_counts():
    from rlsys.metrics import console_line

    line = console_line(0, 10, {"rollout/groups_sampled": 12.0, "rollout/groups_kept": 4.0,
                                "rollout/zero_var_group_frac": 0.75, "rollout/sample_rounds": 2.0})
    assert "groups 4/12 (zero-var 0.75, 2 rnd)" in line
    assert "groups" not in console_line(0, 10, {})


def test_the_first_round_is_sized_by_the_recent_signal_rate_within_the_cap():
    from rlsys.sampling import next_signal_rate

    sieve = GroupSieve(want=4, max_rounds=3, max_oversample=8.0)
    assert sieve.first_round() == 4  # no history: the batch size
    assert sieve.first_round(0.5) == 8
    assert sieve.first_round(0.04) == 32  # 100 boards for 4 groups at 4%, capped at 8 per group
    assert GroupSieve(want=4, enabled=False).first_round(0.04) == 4  # filtering off: one plain round
    rate = 1.0
    for share in [0.5, 0.5, None, 0.0]:
        rate = next_signal_rate(rate, share)
    assert rate == pytest.approx(((1.0 * 0.7 + 0.15) * 0.7 + 0.15) * 0.7)  # None leaves it unchanged


def test_the_signal_rate_is_saved_with_the_cursor():
    from rlsys.data import ItemStream

    items = [{"id": i} for i in range(10)]
    stream = ItemStream(items, seed=1)
    stream.next_batch(3)
    stream.signal_rate = 0.125
    again = ItemStream(items, seed=1)
    again.load_state_dict(stream.state_dict())
    assert again.signal_rate == 0.125 and again.next_batch(2) == stream.next_batch(2)
    state = stream.state_dict()
    del state["signal_rate"]  # a checkpoint from before the rate: starts from 1.0
    again.load_state_dict(state)
    assert again.signal_rate == 1.0


def test_a_truncated_penalty_gives_signal_to_a_group_whose_rewards_agree_only_before_it():
    from rlsys.sampling import training_reward

    # every answer scored 0.5, one of them ran on to the cut: the penalty makes it the worse one
    same = [summary(0, 0.5), summary(0, 0.5), summary(0, 0.5, truncated=1)]
    assert group_signal(same) == {0: False}
    assert group_signal(same, truncated_penalty=1.0) == {0: True}
    assert [training_reward(s, 1.0) for s in same] == [0.5, 0.5, -0.5]
    # all cut: equal again, no signal (the penalty shifts, it does not separate)
    all_cut = [summary(0, 0.5, truncated=1), summary(0, 0.5, truncated=2)]
    assert group_signal(all_cut, truncated_penalty=1.0) == {0: False}
    sieve = GroupSieve(want=1, truncated_penalty=1.0)
    sieve.add(same)
    assert sieve.kept() == {0}


def test_unanimous_groups_join_the_batch_up_to_their_count_in_sampling_order():
    sieve = GroupSieve(want=2, max_rounds=3, unanimous=2)
    failed_only = [summary(3, 0.0, failed=True), summary(3, 0.0, failed=True)]  # unanimous, but no valid member
    sieve.add(groups([1, 1], [0, 1], [0, 0]) + failed_only)  # groups 0..3: 1 has signal, 0 and 2 unanimous
    assert sieve.kept() == {0, 1, 2}  # 1 with signal; the two unanimous with a valid member; never 3
    sieve.add(groups([0, 0], [1, 0], [0, 1], first=sieve.groups_seen))  # 4 unanimous, 5 and 6 with signal
    assert sieve.kept() == {0, 1, 2, 5}  # want 2 with signal (1, 5), unanimous still the first two (0, 2)
    m = sieve.metrics()
    assert m["rollout/groups_kept"] == 2.0 and m["rollout/groups_unanimous_kept"] == 2.0
    assert m["rollout/zero_var_group_frac"] == pytest.approx(4 / 7)
    assert sieve.next_round() == 0  # the unanimous groups do not count towards `want`: it was full with 1 and 5
    assert "rollout/groups_unanimous_kept" not in GroupSieve(want=2).metrics()


def test_batch_below_keeps_the_lowest_rewarded_unanimous_groups_first():
    # groups 0..5: 0 unanimous at 0.8, 1 with signal, 2 at 0.0, 3 at 1.0, 4 at 0.0, 5 at -1.0 (an occupied square)
    rounds = groups([0.8, 0.8], [1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0], [-1.0, -1.0])
    first, lowest = GroupSieve(want=1, unanimous=2), GroupSieve(want=1, unanimous=2, unanimous_pick="lowest")
    for sieve in (first, lowest):
        sieve.add(rounds)
    assert first.kept() == {1, 0, 2}  # sampling order: the 0.8 group before the 0.0 ones
    assert lowest.kept() == {1, 5, 2}  # the lowest: -1.0, then the first of the two 0.0 groups (ties: sampling order)
    assert lowest.metrics()["rollout/groups_unanimous_kept"] == 2.0
    assert GroupSieve(want=1, unanimous=6, unanimous_pick="lowest").kept() == set()  # nothing sampled yet
    off = GroupSieve(want=8, enabled=False, unanimous=2, unanimous_pick="lowest")
    off.add(rounds)
    assert off.kept() == set(range(6))  # without the filter every group is kept anyway


def test_mixed_pick_pushes_the_worst_unanimous_groups_down_and_keeps_the_first_sampled():
    # the same groups: unanimous 0 (0.8), 2 (0.0), 3 (1.0), 4 (0.0), 5 (-1.0); 1 has signal
    rounds = groups([0.8, 0.8], [1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0], [-1.0, -1.0])
    kept = {}
    for n in (1, 2, 3, 4):
        sieve = GroupSieve(want=1, unanimous=n, unanimous_pick="mixed")
        sieve.add(rounds)
        kept[n] = sieve.kept() - {1}
    assert kept[1] == {5}  # one group: the lowest (rounded up half)
    assert kept[2] == {5, 0}  # the lowest, then the first sampled of the others (0.8), not the second-lowest
    assert kept[3] == {5, 2, 0}  # two lowest (-1.0, then the first 0.0), then the first sampled
    assert kept[4] == {5, 2, 0, 3}  # ... then the next sampled of the rest: 3 (group 4 ties 2 but comes later)
    with pytest.raises(ValueError, match="unanimous_pick must be first, lowest or mixed"):
        bad = GroupSieve(want=1, unanimous=2, unanimous_pick="random")
        bad.add(rounds)
        bad.kept()


def test_unanimous_pick_defaults_follow_the_baseline_and_needs_unanimous_groups():
    from rlsys.config import ConfigError, load_config

    on = ["algo.dynamic_sampling=true", "algo.unanimous_groups=2"]
    assert load_config(overrides=on + ["algo.unanimous_baseline=batch"]).algo.unanimous_order() == "first"
    assert load_config(overrides=on + ["algo.unanimous_baseline=batch_below"]).algo.unanimous_order() == "lowest"
    mixed = load_config(overrides=on + ["algo.unanimous_baseline=batch", "algo.unanimous_pick=mixed"])
    assert mixed.algo.unanimous_order() == "mixed"
    with pytest.raises(ConfigError, match="algo.unanimous_pick = 'mixed'"):
        load_config(overrides=["algo.dynamic_sampling=true", "algo.unanimous_baseline=batch",
                               "algo.unanimous_pick=mixed"])
    with pytest.raises(ConfigError, match="unanimous_pick"):
        load_config(overrides=on + ["algo.unanimous_baseline=batch", "algo.unanimous_pick=worst"])


def test_unanimous_groups_need_the_batch_baseline_and_the_filter():
    from rlsys.config import ConfigError, load_config

    cfg = load_config(overrides=["algo.dynamic_sampling=true", "algo.unanimous_baseline=batch",
                                 "algo.unanimous_groups=4"])
    assert (cfg.algo.unanimous_baseline, cfg.algo.unanimous_groups) == ("batch", 4)
    assert load_config().algo.unanimous_baseline == "none"
    with pytest.raises(ConfigError, match="algo.unanimous_groups = 4"):
        load_config(overrides=["algo.dynamic_sampling=true", "algo.unanimous_groups=4"])
    with pytest.raises(ConfigError, match="algo.unanimous_groups = 2"):
        load_config(overrides=["algo.unanimous_baseline=batch", "algo.unanimous_groups=2"])
    with pytest.raises(ConfigError, match="algo.unanimous_baseline: GSPO/GRPO only"):
        load_config(overrides=["algo.name=sft", "algo.unanimous_baseline=batch"])
    below = load_config(overrides=["algo.dynamic_sampling=true", "algo.unanimous_baseline=batch_below",
                                   "algo.unanimous_groups=2"])
    assert (below.algo.unanimous_baseline, below.algo.unanimous_groups) == ("batch_below", 2)
    with pytest.raises(ConfigError, match="unanimous_baseline"):
        load_config(overrides=["algo.unanimous_baseline=below"])
