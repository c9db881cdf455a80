"""`rlsys train` hands its own start-up milestones (interpreter up, config loaded) to `run_training`, which reports
them with the job's (`startup/*`): on a fresh GPU machine the time before `run_training` was the unexplained part."""
from __future__ import annotations

import time

import jobs.train
from rlsys import cli


def test_train_passes_its_start_up_milestones(monkeypatch, tmp_path):
    seen = {}

    def run_training(cfg, marks=None):
        seen.update(cfg=cfg, marks=marks, returned_at=time.time())
        return tmp_path

    monkeypatch.setattr(jobs.train, "run_training", run_training)
    began = time.time()
    assert cli.main(["train", "--config", "configs/tictactoe-tiny-cpu.toml", "--max-steps", "3",
                     "--run-dir", str(tmp_path)]) == 0
    marks = seen["marks"]
    assert set(marks) == {"cli_started", "config_loaded"}
    assert marks["cli_started"] == cli.STARTED_AT <= began <= marks["config_loaded"] <= seen["returned_at"]
    assert seen["cfg"].max_steps == 3
    names = [key for key, _ in jobs.train.STARTUP_MILESTONES]
    assert names[:3] == ["cli_started", "config_loaded", "driver_entered"]  # printed in the order reached
