"""`learner.reference_actor`: the KL reference in its own process (actors/reference.py). Its logprobs are the
reference's own, and a learner that takes them from the rows trains exactly as one that runs the reference itself."""
from __future__ import annotations

import pytest
import torch

from rlsys.types import Segment, Trajectory
from tests.conftest import job_config

pytestmark = pytest.mark.timeout(300)


def _trajectories() -> list[Trajectory]:
    """Two boards of four samples (each board's prompt shared: the prefix-sharing path), one sample failed."""
    out = []
    for group, prompt in enumerate(([5, 6, 7], [5, 6, 11, 12])):
        for sample, reward in enumerate([1.0, 0.0, 0.5, -1.0]):
            answer = [8 + sample, 9, 10][: 3 - sample % 2]
            seg = Segment(input_ids=prompt + answer, loss_mask=[0] * len(prompt) + [1] * len(answer),
                          rollout_logprobs=[0.0] * len(prompt) + [-1.0] * len(answer))
            out.append(Trajectory(item_id=f"b{group}", group=group, sample=sample, segments=[seg], reward=reward,
                                  num_turns=1, failed=group == 1 and sample == 3))
    return out


def _reference(cfg):
    from actors.reference import Reference
    from jobs.placement import learner_settings

    return Reference(learner_settings(cfg))


def test_annotate_adds_the_reference_models_logprob_of_every_token(tmp_path, tiny_model_path):
    from transformers import AutoModelForCausalLM

    cfg = job_config(tmp_path, "algo.kl_coef=0.1", "learner.reference_actor=true")
    trajs = _reference(cfg).annotate(*_trajectories())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    for t in trajs:
        seg = t.segments[0]
        if t.failed:  # never trained on: not run
            assert seg.ref_logprobs is None
            continue
        ids = torch.tensor([seg.input_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)  # (T-1, V)
        want = logp.gather(-1, ids[0, 1:, None])[:, 0]
        got = torch.tensor(seg.ref_logprobs)
        assert got.shape == (len(seg.input_ids),) and got[0] == 0.0
        sampled = torch.tensor(seg.loss_mask[1:], dtype=torch.bool)  # exact where the penalty reads them
        torch.testing.assert_close(got[1:][sampled], want[sampled], atol=1e-5, rtol=0)
    one = _reference(cfg).annotate(_trajectories()[0])  # one trajectory in, one out (Ray's num_returns=1)
    assert isinstance(one, Trajectory) and one.segments[0].ref_logprobs is not None


def test_a_learner_on_the_actors_logprobs_trains_as_one_that_runs_the_reference(tmp_path, tiny_model_path):
    from tests.conftest import make_learner

    own = make_learner(job_config(tmp_path, "algo.kl_coef=0.5"), tiny_model_path)
    cfg = job_config(tmp_path, "algo.kl_coef=0.5", "learner.reference_actor=true")
    taking = make_learner(cfg, tiny_model_path)
    assert taking.ref_model is None  # no second copy of the weights in the learner
    reference = _reference(cfg)
    for step in range(3):
        a = own.train(_trajectories())
        b = taking.train(reference.annotate(*_trajectories()))
        assert b["train/kl_ref"] == pytest.approx(a["train/kl_ref"], rel=1e-5, abs=1e-9), step
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5, abs=1e-9), step
    assert a["train/kl_ref"] > 1e-6  # the policy moved away from the reference, and both measured the same
    for (name, p), q in zip(own.model.named_parameters(), taking.model.parameters()):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=0, msg=name)


def test_a_batch_without_the_actors_logprobs_is_refused_not_trained_without_the_penalty(tmp_path, tiny_model_path):
    from tests.conftest import make_learner

    learner = make_learner(job_config(tmp_path, "algo.kl_coef=0.1", "learner.reference_actor=true"), tiny_model_path)
    with pytest.raises(RuntimeError, match="reference_actor"):
        learner.train(_trajectories())


def test_reference_actor_needs_a_kl_penalty(tmp_path):
    with pytest.raises(Exception, match="learner.reference_actor: runs the KL reference of algo.kl_coef"):
        job_config(tmp_path, "learner.reference_actor=true")


def test_a_segment_refuses_reference_logprobs_of_another_length():
    with pytest.raises(ValueError, match="ref_logprobs 2"):
        Segment(input_ids=[1, 2, 3], loss_mask=[0, 1, 1], rollout_logprobs=[0.0, -1.0, -1.0], ref_logprobs=[0.0, -1.0])


def test_a_learner_that_runs_the_reference_ignores_logprobs_the_rows_carry(tmp_path, tiny_model_path):
    """The config names the source: rows annotated elsewhere (a benchmark's batches reused across variants) do not
    replace the learner's own reference."""
    from tests.conftest import make_learner

    cfg = job_config(tmp_path, "algo.kl_coef=0.5")
    plain = make_learner(cfg, tiny_model_path).train(_trajectories())
    carried = _trajectories()
    for t in carried:
        for seg in t.segments:
            seg.ref_logprobs = [-5.0] * len(seg.input_ids)  # far from the reference's own
    got = make_learner(cfg, tiny_model_path).train(carried)
    assert got["train/kl_ref"] == pytest.approx(plain["train/kl_ref"], abs=1e-9)
    assert got["train/loss"] == pytest.approx(plain["train/loss"], rel=1e-6, abs=1e-9)
