"""`algo.collapse_steps` / `algo.stop_on_collapse`: the driver's count of steps whose groups were all unanimous
(rlsys/collapse.py `CollapseWatch`, counted by jobs/train.py)."""
from __future__ import annotations

import pytest

from rlsys.collapse import CollapseWatch


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


# steps whose groups were all unanimous (U) in two GPU runs of docs/data (`rollout/zero_var_group_frac` 1)
FROZEN = (".....................UUUUUUUUU..UU.UUUUUUUUUUU.UUUUU.UUUUUUUUUUU..UU.U.UU.U.UUUU.UUUUUUUU.UUUUUUU..UU..."
          "U.U...")  # gpu-2026-12-06f s2, steps 1-110: "the first free square" from step 22 to its end at 209
RECOVERED = ("............UUUUUUUUUUUUUUUUUUU.UUUUU..U.U.............................U.U.U..U..................."
             "............")  # gpu-2026-12-06 e0, steps 1-110: 19 in a row, then learned on to 0.848 optimal


def run(watch: CollapseWatch, pattern: str) -> list[bool]:
    """`steps`' stop after each step of ``pattern`` (U: every group unanimous, else one with signal)."""
    return [stop for _, stop in steps(watch, [1.0 if c == "U" else 0.9 for c in pattern])]


def test_a_share_of_the_window_catches_a_frozen_policy_whose_odd_step_has_signal(capsys):
    """`algo.collapse_share`: the seed-2 run of the twenty-ninth session never had 20 all-unanimous steps in a row
    before step 209, but 32 of the 40 before step 58."""
    stops = run(CollapseWatch(20, stop=True, share=0.8), FROZEN)
    assert stops.count(True) == 1 and stops.index(True) + 1 == 58
    out = capsys.readouterr().out
    assert "every group of 32 of the last 40 steps was unanimous" in out and "algo.kl_coef" in out
    assert not any(run(CollapseWatch(20, stop=True, share=1.0), FROZEN)), "the streak alone: no collapse by 110"


def test_a_run_that_recovered_is_not_called_collapsed(capsys):
    """A run whose entropy control brought it back after 19 all-unanimous steps in a row (26 of any 40), and the
    runs of 2026-12-06 that did not collapse (0-17 of any 40), are not stopped."""
    assert not any(run(CollapseWatch(20, stop=True, share=0.8), RECOVERED))
    assert not any(run(CollapseWatch(20, stop=True, share=0.8), ("UUUUUU" + "." * 34) * 10))
    assert "collapsed" not in capsys.readouterr().out


def test_the_share_needs_a_full_window_and_rounds_up():
    assert run(CollapseWatch(3, stop=True, share=0.5), "U.U.U.") == [False] * 5 + [True]  # 3 of 6 once 6 are in
    assert not any(run(CollapseWatch(3, stop=True, share=0.55), "U.U.U." * 3))  # 3.3 -> 4 of 6


def test_the_share_field_is_checked():
    from rlsys.config import ConfigError, load_config

    assert load_config().algo.collapse_share == 0.8
    assert load_config(overrides=["algo.collapse_share=1"]).algo.collapse_share == 1.0
    for bad in ("0", "1.5"):
        with pytest.raises(ConfigError, match="collapse_share"):
            load_config(overrides=[f"algo.collapse_share={bad}"])
