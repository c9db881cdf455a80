"""`algo.collapse_steps` / `algo.stop_on_collapse`: the driver's count of steps whose groups were all unanimous
(jobs/train.py `CollapseWatch`)."""
from __future__ import annotations

import pytest

from jobs.train import CollapseWatch


def steps(watch: CollapseWatch, fracs: list[float]) -> list[tuple[float, bool]]:
    """(`rollout/unanimous_streak`, stop) after each step whose zero-variance fraction is in ``fracs``."""
    out = []
    for f in fracs:
        m = {"rollout/zero_var_group_frac": f, "train/entropy": 0.003}
        stop = watch.update(m)
        out.append((m["rollout/unanimous_streak"], stop))
    return out


def test_the_streak_counts_all_unanimous_steps_in_a_row_and_a_step_with_signal_resets_it(capsys):
    watch = CollapseWatch(3, stop=False)
    got = steps(watch, [1.0, 1.0, 0.875, 1.0, 1.0, 1.0, 1.0])
    assert [s for s, _ in got] == [1, 2, 0, 1, 2, 3, 4]
    assert not any(stop for _, stop in got), "stop_on_collapse is off: the run goes on"
    out = capsys.readouterr().out
    assert out.count("WARNING the policy has collapsed") == 1, "said once, when the streak reaches 3"
    assert "last 3 steps" in out and "algo.kl_coef" in out and "algo.stop_on_collapse=true" in out


def test_a_collapse_into_cut_off_answers_names_the_cut_and_the_penalty(capsys):
    watch = CollapseWatch(2, stop=False)
    for cut in (0.9, 0.95):
        watch.update({"rollout/zero_var_group_frac": 1.0, "train/entropy": 2.4, "rollout/truncated_frac": cut})
    out = capsys.readouterr().out
    assert "95% of this step's answers ran on to rollout.max_new_tokens" in out and "algo.truncated_penalty" in out
    watch = CollapseWatch(2, stop=False)
    for _ in range(2):
        watch.update({"rollout/zero_var_group_frac": 1.0, "train/entropy": 0.003, "rollout/truncated_frac": 0.1})
    out = capsys.readouterr().out
    assert "WARNING the policy has collapsed" in out and "max_new_tokens" not in out, "answers that end: no cut"


def test_stop_on_collapse_stops_at_the_step_the_streak_reaches_the_limit():
    watch = CollapseWatch(2, stop=True)
    assert [stop for _, stop in steps(watch, [1.0, 0.5, 1.0, 1.0])] == [False, False, False, True]


def test_zero_steps_turn_the_watch_off():
    watch = CollapseWatch(0, stop=True)
    m = {"rollout/zero_var_group_frac": 1.0}
    assert not any(watch.update(m) for _ in range(50)) and "rollout/unanimous_streak" not in m


def test_the_config_fields():
    from rlsys.config import ConfigError, load_config

    cfg = load_config(overrides=["algo.collapse_steps=5", "algo.stop_on_collapse=true"])
    assert (cfg.algo.collapse_steps, cfg.algo.stop_on_collapse) == (5, True)
    assert load_config().algo.collapse_steps == 20 and not load_config().algo.stop_on_collapse
    with pytest.raises(ConfigError, match="collapse_steps"):
        load_config(overrides=["algo.collapse_steps=-1"])


def test_a_share_of_the_window_catches_a_frozen_policy_whose_odd_step_has_signal(capsys):
    """`algo.collapse_share`: the twenty-ninth session's seed-2 run answered "the first free square" from step 22 on,
    every group unanimous on most steps and one group with signal on the odd one, so the streak never reached 20
    until step 209; 16 of 20 is reached on the window's first full count."""
    frozen = [0.5] * 5 + ([1.0] * 4 + [0.5]) * 10  # 4 of every 5 steps all unanimous after the first five
    watch = CollapseWatch(10, stop=True, share=0.8)
    got = []
    for f in frozen:
        m = {"rollout/zero_var_group_frac": f, "train/entropy": 0.004}
        got.append((watch.update(m), m["rollout/unanimous_steps"], m["rollout/unanimous_streak"]))
    fired = [i for i, (stop, _, _) in enumerate(got) if stop]
    assert len(fired) == 1, "declared once"
    stop_at = fired[0]
    assert got[stop_at][1] >= 8 and max(s for _, _, s in got[:stop_at + 1]) < 10, "by the share, not a streak"
    assert "of the last 10 steps was unanimous" in capsys.readouterr().out
    strict = CollapseWatch(10, stop=True, share=1.0)  # the old rule: ten in a row, which this pattern never has
    assert not any(strict.update({"rollout/zero_var_group_frac": f}) for f in frozen)


def test_a_learning_run_with_a_few_unanimous_steps_is_not_called_collapsed(capsys):
    """The healthy runs on record had at most 4 all-unanimous steps in any 40 (seven GPU runs, 2026-12-06)."""
    watch = CollapseWatch(20, stop=True, share=0.8)
    healthy = ([1.0] * 4 + [0.9] * 16) * 20  # 4 in every 20, some in a row
    assert not any(watch.update({"rollout/zero_var_group_frac": f}) for f in healthy)
    assert "collapsed" not in capsys.readouterr().out


def test_the_share_needs_a_full_window_and_rounds_up():
    watch = CollapseWatch(5, stop=True, share=0.7)  # 3.5 -> 4 of 5
    assert [watch.update({"rollout/zero_var_group_frac": f}) for f in (1.0, 1.0, 1.0, 0.5, 0.5)] == [False] * 5
    assert watch.update({"rollout/zero_var_group_frac": 1.0}) is False  # 3 of the last 5
    assert watch.update({"rollout/zero_var_group_frac": 1.0}) is False  # 3: (1.0, 0.5, 0.5, 1.0, 1.0)
    assert [watch.update({"rollout/zero_var_group_frac": 1.0}) for _ in range(2)] == [False, True]  # 4, then said


def test_the_share_field_is_checked():
    from rlsys.config import ConfigError, load_config

    assert load_config().algo.collapse_share == 0.8
    assert load_config(overrides=["algo.collapse_share=1"]).algo.collapse_share == 1.0
    for bad in ("0", "1.5"):
        with pytest.raises(ConfigError, match="collapse_share"):
            load_config(overrides=[f"algo.collapse_share={bad}"])
