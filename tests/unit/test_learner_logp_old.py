"""`algo.logp_mode = "decoupled"`: where the learner's logp_old comes from.

With one optimizer step per batch the update's own forward, detached, is logp_old (no second forward, a ratio of
exactly 1); with several, one recompute before the first step."""
from __future__ import annotations

import math

import pytest

from tests.conftest import job_config
from tests.unit.test_prefix_sharing import _trajectories

pytestmark = pytest.mark.timeout(300)


def _learner(tmp_path, tiny_model_path, *overrides: str):
    from tests.conftest import make_learner

    # 3 boards x 3 samples of the test's 9 trajectories: micro-batches of 3 split a board, so a recompute and the
    # update run different micro-batches (as in a job)
    return make_learner(job_config(tmp_path, "algo.name=gspo", "algo.logp_mode=decoupled", *overrides, mini_bs="3",
                                   batch_size="3", n_samples="3"), tiny_model_path)


def test_one_minibatch_takes_logp_old_from_the_update_forward(tmp_path, tiny_model_path, monkeypatch):
    """Same gradients as the recompute (float32: the two agree to rounding), without calling it, and the GSPO ratio
    is exactly 1, so nothing can be clipped by a recompute's rounding."""
    recomputing = _learner(tmp_path, tiny_model_path)
    rows, _ = recomputing._policy_rows(_trajectories())
    recomputing._last_trained, recomputing._tokens = [], [0, 0]
    expected = recomputing._minibatch(rows, recomputing._recompute_old_logprobs(rows), first=True)
    grads = {n: p.grad.clone() for n, p in recomputing.model.named_parameters()}

    learner = _learner(tmp_path, tiny_model_path)

    def forbidden(rows):
        raise AssertionError("logp_old recomputed with one optimizer step per batch")

    monkeypatch.setattr(learner, "_recompute_old_logprobs", forbidden)
    stats = learner.train(_trajectories())
    assert learner.optimizer_steps == 1
    assert stats["train/ratio_mean"] == 1.0 and stats["train/ratio_std"] == 0.0
    assert stats["train/clip_frac"] == 0.0
    assert stats["train/tis_weight_mean"] == pytest.approx(expected["train/tis_weight_mean"], rel=1e-5)
    assert stats["train/loss"] == pytest.approx(expected["train/loss"], rel=1e-5, abs=1e-7)
    assert stats["train/grad_norm"] == pytest.approx(expected["train/grad_norm"], rel=1e-5)

    # the gradients before the step: rerun the same minibatch on a fresh learner without the recompute
    fresh = _learner(tmp_path, tiny_model_path)
    monkeypatch.setattr(fresh, "_recompute_old_logprobs", forbidden)
    fresh._last_trained, fresh._tokens = [], [0, 0]
    fresh._minibatch(rows, None, first=True)
    for name, p in fresh.model.named_parameters():
        assert p.grad is not None, name
        assert (p.grad - grads[name]).abs().max() <= 1e-5 * max(float(grads[name].abs().max()), 1e-6), name


def test_several_minibatches_recompute_once_before_the_first_step(tmp_path, tiny_model_path, monkeypatch):
    learner = _learner(tmp_path, tiny_model_path, "algo.n_minibatches=3")
    calls = []
    real = learner._recompute_old_logprobs

    def counted(rows):
        calls.append(len(rows))
        return real(rows)

    monkeypatch.setattr(learner, "_recompute_old_logprobs", counted)
    stats = learner.train(_trajectories())
    assert calls == [9]  # every row, once
    assert learner.optimizer_steps == 3
    assert stats["train/ratio_std"] > 0.0  # the second and third steps see moved weights


def test_a_nan_gradient_skips_the_step_and_names_the_parameter(tmp_path, tiny_model_path, capsys):
    """A NaN in one parameter's gradient with a finite loss (what an attention kernel's backward did on the GPU):
    no optimizer step, the weights stay, and the log line names the parameter and the rows' lengths."""
    import torch

    learner = _learner(tmp_path, tiny_model_path)
    name, param = next((n, p) for n, p in learner.model.named_parameters() if "q_proj" in n)
    param.register_hook(lambda g: torch.full_like(g, float("nan")))
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    stats = learner.train(_trajectories())
    assert stats["train/skipped_steps"] == 1.0 and learner.optimizer_steps == 0
    assert math.isfinite(stats["train/loss"])  # only the gradient is NaN
    for n, p in learner.model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "learner step skipped" in ln)
    assert f"1 parameter tensors with a non-finite gradient (first: {name})" in line
    assert "row lengths" in line
