"""`max_train_minutes`: the driver's steps stop at the time box (jobs/train.py `training_steps`)."""
from __future__ import annotations

import jobs.train as train


def test_steps_run_to_max_steps_without_a_time_box_or_within_it():
    assert list(train.training_steps(2, 6, 0.0, None)) == [2, 3, 4, 5]
    assert list(train.training_steps(0, 3, train.time.time(), 10.0)) == [0, 1, 2]


def test_no_step_starts_after_the_time_box(monkeypatch, capsys):
    clock = iter([100.0, 130.0, 159.0, 161.0, 170.0])  # seconds at each check; the box is 1 minute from 100
    monkeypatch.setattr(train.time, "time", lambda: next(clock))
    assert list(train.training_steps(0, 10, 100.0, 1.0)) == [0, 1, 2]
    assert "max_train_minutes=1 reached before step 3: training stops" in capsys.readouterr().out


def test_the_config_refuses_a_nonpositive_time_box():
    import pytest

    from rlsys.config import ConfigError, load_config

    assert load_config(overrides=["max_train_minutes=12.5"]).max_train_minutes == 12.5
    with pytest.raises(ConfigError, match="max_train_minutes"):
        load_config(overrides=["max_train_minutes=0"])
