"""`train/lr`: the learning rate the batch's optimizer step used, through warm-up (it once logged the next one)."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import job_config
from tests.faults.test_learner_faults import _trajectories

pytestmark = pytest.mark.timeout(300)


def _learner(tmp_path, model_path, *overrides: str):
    from tests.conftest import make_learner

    return make_learner(job_config(tmp_path, "learner.warmup_steps=4", "learner.lr_schedule=constant", *overrides,
                                   lr="1e-3"), model_path)


def test_logged_lr_is_the_one_each_warm_up_step_used(tmp_path, tiny_model_path):
    learner = _learner(tmp_path, tiny_model_path)
    used, logged = [], []  # what the optimizer applies, read as it applies it
    learner.optimizer.register_step_pre_hook(lambda opt, args, kwargs: used.append(opt.param_groups[0]["lr"]))
    for _ in range(5):
        logged.append(learner.train(_trajectories())["train/lr"])
    assert used == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    assert logged == pytest.approx(used)


def test_two_optimizer_steps_log_the_second_ones_lr(tmp_path, tiny_model_path):
    learner = _learner(tmp_path, tiny_model_path, "algo.n_minibatches=2")
    stats = learner.train(_trajectories())
    assert learner.optimizer_steps == 2
    assert stats["train/lr"] == pytest.approx(5e-4)  # steps at 2.5e-4 then 5e-4


def test_a_skipped_step_logs_the_lr_it_would_have_used(tmp_path, tiny_model_path):
    learner = _learner(tmp_path, tiny_model_path)
    with torch.no_grad():
        learner.model.model.norm.weight.fill_(float("inf"))  # every logit NaN: the step is skipped
    stats = learner.train(_trajectories())
    assert stats["train/skipped_steps"] == 1.0 and learner.optimizer_steps == 0
    assert stats["train/lr"] == pytest.approx(2.5e-4)
